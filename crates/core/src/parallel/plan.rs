//! How a decoder is split over `world` GPUs (tensor parallelism, as vLLM splits it), as pure
//! arithmetic on the model's shape:
//!
//! - q/k/v and gate/up are split by output rows (column-parallel): each rank computes its own
//!   heads and its own slice of the MLP's intermediate width;
//! - o and down are split by input columns (row-parallel): each rank's partial sums are added by
//!   one all-reduce after each, and their biases are added by rank 0 only;
//! - the embedding and the LM head are split by vocabulary rows, padded to the same count on
//!   every rank: an embedding row is taken by the rank holding it (zeros elsewhere, then an
//!   all-reduce); the head's logits are gathered from every rank;
//! - KV heads are split across ranks; with fewer KV heads than ranks, each is replicated on the
//!   ranks whose query heads read it.
//!
//! Norms and rotary tables are replicated.

use crate::models::DecoderConfig;
use std::ops::Range;

/// A rank's part of one checkpoint tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Split {
    /// Rows `rows` of dimension 0 (of `full` rows), padded with zero rows to `padded`.
    Rows {
        rows: Range<usize>,
        full: usize,
        padded: usize,
    },
    /// Columns `cols` of dimension 1 of a matrix of `full` columns.
    Cols { cols: Range<usize>, full: usize },
    /// The whole tensor on rank 0, zeros elsewhere (a row-parallel layer's bias: added once).
    RankZero,
}

/// One rank's share of a decoder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpPlan {
    pub rank: usize,
    pub world: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    intermediate: usize,
    vocab: usize,
}

impl TpPlan {
    /// Rank `rank` of `world` for a model of `cfg`'s shape; an error says why the shape does not
    /// split (heads or the MLP's width not divisible, KV heads neither a multiple nor a divisor
    /// of the ranks).
    pub fn new(cfg: &DecoderConfig, rank: usize, world: usize) -> Result<Self, String> {
        if world == 0 || rank >= world {
            return Err(format!("rank {rank} of a tensor-parallel group of {world}"));
        }
        let (heads, kv) = (cfg.num_heads, cfg.num_kv_heads);
        if !heads.is_multiple_of(world) {
            return Err(format!(
                "the model's {heads} attention heads do not split over {world} GPUs \
                 (--tensor-parallel-size must divide the number of heads)"
            ));
        }
        if kv == 0 || !heads.is_multiple_of(kv) {
            return Err(format!(
                "{heads} query heads do not group over {kv} KV heads"
            ));
        }
        if !kv.is_multiple_of(world) && !world.is_multiple_of(kv) {
            return Err(format!(
                "the model's {kv} KV heads neither split over nor replicate across {world} GPUs"
            ));
        }
        if !cfg.intermediate_size.is_multiple_of(world) {
            return Err(format!(
                "the MLP's width {} does not split over {world} GPUs",
                cfg.intermediate_size
            ));
        }
        Ok(Self {
            rank,
            world,
            heads,
            kv_heads: kv,
            head_dim: cfg.head_dim,
            intermediate: cfg.intermediate_size,
            vocab: cfg.vocab_size,
        })
    }

    /// Query heads on each rank.
    pub fn local_heads(&self) -> usize {
        self.heads / self.world
    }

    /// KV heads on each rank (1 when they are replicated).
    pub fn local_kv_heads(&self) -> usize {
        (self.kv_heads / self.world).max(1)
    }

    /// This rank's query heads.
    pub fn heads(&self) -> Range<usize> {
        let n = self.local_heads();
        self.rank * n..(self.rank + 1) * n
    }

    /// This rank's KV heads: its share, or the one head its query heads read.
    pub fn kv_heads(&self) -> Range<usize> {
        if self.kv_heads >= self.world {
            let n = self.local_kv_heads();
            self.rank * n..(self.rank + 1) * n
        } else {
            let group = self.heads / self.kv_heads;
            let first = self.heads().start / group;
            first..first + 1
        }
    }

    /// How many ranks hold each KV head (1 unless replicated).
    pub fn kv_replicas(&self) -> usize {
        (self.world / self.kv_heads).max(1)
    }

    /// This rank's columns of the MLP's intermediate width.
    pub fn intermediate(&self) -> Range<usize> {
        let n = self.intermediate / self.world;
        self.rank * n..(self.rank + 1) * n
    }

    /// Vocabulary rows on each rank (the last rank's padded with zero rows).
    pub fn vocab_per_rank(&self) -> usize {
        self.vocab.div_ceil(self.world)
    }

    /// This rank's vocabulary rows that exist (the last rank may hold fewer, or none).
    pub fn vocab(&self) -> Range<usize> {
        let n = self.vocab_per_rank();
        let start = (self.rank * n).min(self.vocab);
        start..((self.rank + 1) * n).min(self.vocab)
    }

    /// The shape each rank loads: heads, KV heads, MLP width and vocabulary rows its own (the
    /// engine still serves the full model's config).
    pub fn local_config(&self, cfg: &DecoderConfig) -> DecoderConfig {
        DecoderConfig {
            num_heads: self.local_heads(),
            num_kv_heads: self.local_kv_heads(),
            intermediate_size: self.intermediate.div_ceil(self.world),
            vocab_size: self.vocab_per_rank(),
            ..cfg.clone()
        }
    }

    /// This rank's part of the checkpoint tensor `name` (Hugging Face names); `None` for a
    /// tensor every rank holds whole (norms).
    pub fn split_of(&self, name: &str) -> Option<Split> {
        let d = self.head_dim;
        let rows = |r: Range<usize>, full: usize| Split::Rows {
            padded: r.len(),
            rows: r,
            full,
        };
        let scaled = |r: Range<usize>| r.start * d..r.end * d;
        let (layer, param) = name.rsplit_once('.')?;
        let proj = layer.rsplit('.').next()?;
        let weight = param == "weight";
        match (proj, param) {
            ("q_proj", "weight" | "bias") => Some(rows(scaled(self.heads()), self.heads * d)),
            ("k_proj" | "v_proj", "weight" | "bias") => {
                Some(rows(scaled(self.kv_heads()), self.kv_heads * d))
            }
            ("gate_proj" | "up_proj", "weight" | "bias") => {
                Some(rows(self.intermediate(), self.intermediate))
            }
            ("o_proj", _) if weight => Some(Split::Cols {
                cols: scaled(self.heads()),
                full: self.heads * d,
            }),
            ("down_proj", _) if weight => Some(Split::Cols {
                cols: self.intermediate(),
                full: self.intermediate,
            }),
            ("o_proj" | "down_proj", "bias") => Some(Split::RankZero),
            ("embed_tokens" | "lm_head", "weight") => Some(Split::Rows {
                rows: self.vocab(),
                full: self.vocab,
                padded: self.vocab_per_rank(),
            }),
            _ => None,
        }
    }
}

/// The layers whose outputs are partial sums on each rank, reduced by one all-reduce each (per
/// decoder layer), plus the embedding lookup.
pub const REDUCED_AFTER: [&str; 3] = ["embed_tokens", "o_proj", "down_proj"];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::layers::rotary::{RopeConfig, RopeScaling};

    fn cfg(heads: usize, kv: usize, inter: usize, vocab: usize, hidden: usize) -> DecoderConfig {
        DecoderConfig {
            architecture: "LlamaForCausalLM".into(),
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: inter,
            num_layers: 2,
            num_heads: heads,
            num_kv_heads: kv,
            head_dim: hidden / heads,
            rms_norm_eps: 1e-5,
            rope: RopeConfig {
                theta: 10000.0,
                scaling: RopeScaling::None,
            },
            max_position_embeddings: 128,
            tie_word_embeddings: false,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            qk_norm: false,
            sliding_window: vec![None; 2],
            mrope_section: None,
        }
    }

    fn llama8b() -> DecoderConfig {
        cfg(32, 8, 14336, 128256, 4096)
    }

    fn plans(c: &DecoderConfig, world: usize) -> Vec<TpPlan> {
        (0..world)
            .map(|r| TpPlan::new(c, r, world).expect("splits"))
            .collect()
    }

    /// Every rank's rows or columns of a split tensor, in rank order, tile it exactly once.
    fn tiles(splits: &[Split]) -> bool {
        let mut next = 0;
        let mut full = 0;
        for s in splits {
            let (r, f) = match s {
                Split::Rows { rows, full, .. } => (rows.clone(), *full),
                Split::Cols { cols, full } => (cols.clone(), *full),
                Split::RankZero => return false,
            };
            if r.start != next {
                return false;
            }
            next = r.end;
            full = f;
        }
        next == full
    }

    #[test]
    fn llama_8b_shards_like_vllm() {
        let c = llama8b();
        for world in [1, 2, 4, 8] {
            let ps = plans(&c, world);
            for p in &ps {
                let local = p.local_config(&c);
                assert_eq!(local.num_heads * world, 32);
                assert_eq!(local.num_kv_heads * world, 8);
                assert_eq!(local.intermediate_size * world, 14336);
                assert_eq!(local.hidden_size, 4096);
                assert_eq!(local.vocab_size, 128256 / world);
                assert_eq!(p.kv_replicas(), 1);
            }
            for name in [
                "model.layers.3.self_attn.q_proj.weight",
                "model.layers.3.self_attn.k_proj.weight",
                "model.layers.3.self_attn.v_proj.bias",
                "model.layers.3.self_attn.o_proj.weight",
                "model.layers.3.mlp.gate_proj.weight",
                "model.layers.3.mlp.up_proj.weight",
                "model.layers.3.mlp.down_proj.weight",
                "model.embed_tokens.weight",
                "lm_head.weight",
            ] {
                let splits: Vec<Split> = ps.iter().filter_map(|p| p.split_of(name)).collect();
                assert_eq!(splits.len(), world, "{name}");
                assert!(tiles(&splits), "{name} at {world}: {splits:?}");
            }
            let q = ps[world - 1].split_of("model.layers.0.self_attn.q_proj.weight");
            let n = 4096 / world;
            assert_eq!(
                q,
                Some(Split::Rows {
                    rows: 4096 - n..4096,
                    full: 4096,
                    padded: n
                })
            );
        }
    }

    #[test]
    fn seventy_b_at_four_and_eight() {
        let c = cfg(64, 8, 28672, 128256, 8192);
        for world in [2, 4, 8] {
            for p in plans(&c, world) {
                assert_eq!(p.local_kv_heads(), 8 / world);
                let down = p.split_of("model.layers.79.mlp.down_proj.weight");
                let w = 28672 / world;
                assert_eq!(
                    down,
                    Some(Split::Cols {
                        cols: p.rank * w..(p.rank + 1) * w,
                        full: 28672
                    })
                );
            }
        }
    }

    #[test]
    fn row_parallel_biases_are_added_once_and_norms_replicated() {
        let p = &plans(&llama8b(), 2)[1];
        assert_eq!(
            p.split_of("model.layers.0.self_attn.o_proj.bias"),
            Some(Split::RankZero)
        );
        assert_eq!(
            p.split_of("model.layers.0.mlp.down_proj.bias"),
            Some(Split::RankZero)
        );
        for name in [
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.post_attention_layernorm.weight",
            "model.layers.0.self_attn.q_norm.weight",
            "model.norm.weight",
        ] {
            assert_eq!(p.split_of(name), None, "{name}");
        }
        assert_eq!(REDUCED_AFTER, ["embed_tokens", "o_proj", "down_proj"]);
    }

    #[test]
    fn kv_heads_replicate_when_fewer_than_ranks() {
        // 8 query heads over 2 KV heads (groups of 4) on 4 ranks: ranks 0-1 read KV head 0, 2-3 head 1
        let c = cfg(8, 2, 64, 100, 64);
        let ps = plans(&c, 4);
        let kv: Vec<Range<usize>> = ps.iter().map(TpPlan::kv_heads).collect();
        assert_eq!(kv, [0..1, 0..1, 1..2, 1..2]);
        assert!(ps
            .iter()
            .all(|p| p.local_kv_heads() == 1 && p.kv_replicas() == 2));
        // every local query head reads a KV head its rank holds
        for p in &ps {
            for h in p.heads() {
                assert!(p.kv_heads().contains(&(h / 4)), "rank {} head {h}", p.rank);
            }
        }
        // MQA: one KV head on every rank
        let ps = plans(&cfg(8, 1, 64, 100, 64), 8);
        assert!(ps.iter().all(|p| p.kv_heads() == (0..1)));
    }

    #[test]
    fn grouped_heads_stay_with_their_kv_head() {
        let c = cfg(32, 8, 64, 100, 128);
        for world in [1, 2, 4, 8] {
            for p in plans(&c, world) {
                for h in p.heads() {
                    assert!(p.kv_heads().contains(&(h / 4)));
                }
            }
        }
    }

    #[test]
    fn vocabulary_pads_to_equal_shards() {
        // Qwen2.5's 151936 rows split in 4 evenly; 100 rows over 3 ranks: 34, 34, 32 + 2 padding
        let ps = plans(&cfg(6, 6, 12, 100, 48), 3);
        let rows: Vec<Range<usize>> = ps.iter().map(TpPlan::vocab).collect();
        assert_eq!(rows, [0..34, 34..68, 68..100]);
        assert!(ps.iter().all(|p| p.vocab_per_rank() == 34));
        assert_eq!(
            ps[2].split_of("lm_head.weight"),
            Some(Split::Rows {
                rows: 68..100,
                full: 100,
                padded: 34
            })
        );
    }

    #[test]
    fn shapes_that_do_not_split_are_refused() {
        // Qwen2.5-0.5B: 14 heads, 2 KV heads
        let qwen = cfg(14, 2, 4864, 151936, 896);
        assert!(TpPlan::new(&qwen, 0, 2).is_ok());
        let e = TpPlan::new(&qwen, 0, 4).unwrap_err();
        assert!(e.contains("14 attention heads") && e.contains('4'), "{e}");
        let e = TpPlan::new(&cfg(12, 3, 64, 100, 48), 0, 4).unwrap_err();
        assert!(e.contains("KV heads"), "{e}");
        assert!(TpPlan::new(&cfg(8, 8, 66, 100, 64), 0, 4)
            .unwrap_err()
            .contains("MLP"));
        assert!(TpPlan::new(&llama8b(), 2, 2).is_err());
    }
}
