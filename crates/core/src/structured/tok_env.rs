//! The model's vocabulary as the grammar engine reads it: every token's bytes in one trie.
//!
//! Byte-level BPE vocabularies (GPT-2's byte-to-character map) and SentencePiece ones (`▁` for a
//! space, `<0xNN>` byte-fallback pieces) are both decoded to the exact bytes a token adds to the
//! text. Special and added control tokens carry the trie's special marker, so no grammar can
//! produce them as text; EOS is allowed by the grammar engine itself where the grammar may end.

use crate::tokenizer::Tokenizer;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use std::collections::HashMap;
use std::sync::Arc;

/// How a vocabulary spells bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Spelling {
    /// GPT-2's map of every byte to a printable character.
    ByteLevel,
    /// SentencePiece: `▁` (or the decoder's replaced character) is a space, `<0xNN>` a byte.
    Pieces(char),
}

fn spelling(tok: &Tokenizer) -> Spelling {
    let decoder = tok
        .inner()
        .get_decoder()
        .and_then(|d| serde_json::to_value(d).ok())
        .unwrap_or_default();
    let mut found = None;
    visit_decoders(&decoder, &mut |d| match d["type"].as_str() {
        Some("ByteLevel") => found = Some(Spelling::ByteLevel),
        Some("Replace") if d["content"].as_str() == Some(" ") => {
            let pat = d["pattern"]["String"].as_str().unwrap_or("▁");
            let mut chars = pat.chars();
            if let (Some(c), None) = (chars.next(), chars.next()) {
                found.get_or_insert(Spelling::Pieces(c));
            }
        }
        Some("Metaspace") => {
            let c = d["replacement"]
                .as_str()
                .and_then(|s| s.chars().next())
                .unwrap_or('▁');
            found.get_or_insert(Spelling::Pieces(c));
        }
        _ => {}
    });
    found.unwrap_or(Spelling::Pieces('▁'))
}

fn visit_decoders(d: &serde_json::Value, f: &mut impl FnMut(&serde_json::Value)) {
    f(d);
    if let Some(list) = d["decoders"].as_array() {
        for x in list {
            visit_decoders(x, f);
        }
    }
}

/// GPT-2's byte-to-character map, inverted.
fn byte_level_chars() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut map = HashMap::with_capacity(256);
    let mut next = 256u32;
    for b in 0..=255u8 {
        let c = if printable(b) {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or('\0');
            next += 1;
            c
        };
        map.insert(c, b);
    }
    map
}

/// `<0xNN>` as the byte NN.
fn fallback_byte(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// Every token's bytes, indexed by id (`vocab` entries; ids the tokenizer lacks stay empty, so no
/// grammar ever allows them).
fn token_bytes(tok: &Tokenizer, vocab: usize) -> Vec<Vec<u8>> {
    let mut words = vec![Vec::new(); vocab];
    let spelling = spelling(tok);
    let chars = byte_level_chars();
    let added = tok.inner().get_added_tokens_decoder();
    for (piece, id) in tok.inner().get_vocab(true) {
        let Some(slot) = words.get_mut(id as usize) else {
            continue;
        };
        if let Some(a) = added.get(&id) {
            let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
            if a.special || (piece.starts_with('<') && piece.ends_with('>')) {
                b.extend_from_slice(piece.as_bytes());
                *slot = b;
            } else {
                // an added token that is ordinary text
                *slot = piece.as_bytes().to_vec();
            }
            continue;
        }
        *slot = match spelling {
            Spelling::ByteLevel => piece
                .chars()
                .map(|c| chars.get(&c).copied())
                .collect::<Option<Vec<u8>>>()
                .unwrap_or_else(|| piece.as_bytes().to_vec()),
            Spelling::Pieces(space) => match fallback_byte(&piece) {
                Some(b) => vec![b],
                None => piece.replace(space, " ").into_bytes(),
            },
        };
    }
    words
}

/// The vocabulary for the grammar engine: the trie and the model's tokenizer for literal text.
pub(super) struct ModelTokEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl ModelTokEnv {
    /// The trie of `tokenizer`'s tokens over `vocab` ids (the model's logit width), with `eos`
    /// as the tokens that end the text.
    pub fn build(tokenizer: Arc<Tokenizer>, vocab: usize, eos: &[u32]) -> Result<TokEnv, String> {
        let words = token_bytes(&tokenizer, vocab);
        let eos: Vec<TokenId> = eos
            .iter()
            .copied()
            .filter(|&t| (t as usize) < vocab)
            .collect();
        let first = *eos
            .first()
            .ok_or("the model has no end-of-sequence token")?;
        let vocab_size = u32::try_from(vocab).map_err(|_| "vocabulary too large")?;
        let trie = std::panic::catch_unwind(|| {
            TokTrie::from(&TokRxInfo::new(vocab_size, first), &words).with_eos_tokens(&eos)
        })
        .map_err(|_| "the vocabulary could not be indexed for grammars".to_string())?;
        Ok(Arc::new(Self { trie, tokenizer }))
    }
}

impl TokenizerEnv for ModelTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tokenizer.encode(text, false).unwrap_or_default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok() -> Tokenizer {
        Tokenizer::from_bytes(include_bytes!("../../assets/tokenizer.json")).expect("tokenizer")
    }

    #[test]
    fn byte_level_tokens_decode_to_their_text() {
        let t = tok();
        let words = token_bytes(&t, t.vocab_size());
        for text in ["hello world", " {\"a\": 1}", "中文"] {
            let ids = t.encode(text, false).expect("encode");
            let bytes: Vec<u8> = ids
                .iter()
                .flat_map(|&i| words[i as usize].clone())
                .collect();
            assert_eq!(bytes, text.as_bytes(), "{text}");
        }
    }

    #[test]
    fn special_tokens_are_marked() {
        let t = tok();
        let words = token_bytes(&t, t.vocab_size());
        let specials: Vec<u32> = (0..t.vocab_size() as u32)
            .filter(|&i| t.is_special(i))
            .collect();
        assert!(!specials.is_empty());
        for i in specials {
            assert_eq!(words[i as usize][0], TokTrie::SPECIAL_TOKEN_MARKER);
        }
    }

    #[test]
    fn fallback_pieces_are_bytes() {
        assert_eq!(fallback_byte("<0x0A>"), Some(b'\n'));
        assert_eq!(fallback_byte("<0xZZ>"), None);
        assert_eq!(fallback_byte("<0x0>"), None);
        assert_eq!(byte_level_chars().len(), 256);
    }
}
