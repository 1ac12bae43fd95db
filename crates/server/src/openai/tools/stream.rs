//! The text bookkeeping every format's state machine shares: what was received but not looked at,
//! what was consumed but not sent, and the events ready to go. The formats decide what the text
//! means; this file decides what may be sent.
//!
//! Invariants: `buf` is text not yet consumed; `raw` is consumed text not yet sent (the whitespace
//! that opens a content segment, then the call being read), so that a call that fails can be sent
//! back as the content it was. A content segment (text outside calls) is sent only once it holds
//! something besides whitespace; from then on, verbatim. Once `verbatim` is set every byte goes out
//! as content, in order, and nothing is held.

use super::{call_from_object, call_from_parts, json_value_end, partial_suffix, StreamEvent};
use super::{ToolCall, Value};

/// Whether the held text starts with a literal.
pub(super) enum Lit {
    Yes,
    No,
    /// The held text is a proper prefix of the literal: wait.
    More,
}

#[derive(Debug)]
pub(super) struct Core {
    buf: String,
    raw: String,
    /// Whether the current content segment has sent text.
    segment_sent: bool,
    verbatim: bool,
    fell_back: bool,
    calls: usize,
    /// A call read but not sent: its format sends it once what follows confirms it.
    pending: Option<ToolCall>,
    known: Vec<String>,
    events: Vec<StreamEvent>,
}

impl Core {
    pub(super) fn new(known: Vec<String>) -> Self {
        Self {
            buf: String::new(),
            raw: String::new(),
            segment_sent: false,
            verbatim: false,
            fell_back: false,
            calls: 0,
            pending: None,
            known,
            events: Vec::new(),
        }
    }

    pub(super) fn feed(&mut self, delta: &str) {
        if self.verbatim {
            self.emit(delta);
        } else {
            self.buf.push_str(delta);
        }
    }

    pub(super) fn drain(&mut self) -> Vec<StreamEvent> {
        std::mem::take(&mut self.events)
    }

    /// The output ended and the format's machine has had its last step: anything still held is
    /// whitespace between or after calls (dropped) or an unfinished call (sent as content).
    pub(super) fn close(&mut self) {
        if self.verbatim {
            return;
        }
        if self.buf.is_empty() && self.raw.trim().is_empty() {
            self.raw.clear();
        } else {
            self.fall_back();
        }
    }

    pub(super) fn verbatim(&self) -> bool {
        self.verbatim
    }

    pub(super) fn fell_back(&self) -> bool {
        self.fell_back
    }

    pub(super) fn calls(&self) -> usize {
        self.calls
    }

    pub(super) fn known(&self) -> &[String] {
        &self.known
    }

    /// The text received and not consumed.
    pub(super) fn unread(&self) -> &str {
        &self.buf
    }

    /// Sends content up to `marker` and consumes the marker (true), or sends what cannot be the
    /// start of `marker` and waits for more (false).
    pub(super) fn scan_for(&mut self, marker: &str, eof: bool) -> bool {
        let (cut, found) = match self.buf.find(marker) {
            Some(at) => (at, true),
            None if eof => (self.buf.len(), false),
            None => (self.buf.len() - partial_suffix(&self.buf, marker), false),
        };
        let before: String = self.buf.drain(..cut).collect();
        self.content(&before);
        if found {
            self.take(marker.len());
        }
        found
    }

    /// Consumes leading whitespace.
    pub(super) fn skip_ws(&mut self) {
        let ws = self.buf.len() - self.buf.trim_start().len();
        self.take(ws);
    }

    pub(super) fn peek(&self) -> Option<char> {
        self.buf.chars().next()
    }

    /// The next character after whitespace; at the end of the output, when none is left, the
    /// held text falls back to content.
    pub(super) fn next_or_fall_back(&mut self, eof: bool) -> Option<char> {
        self.skip_ws();
        let c = self.peek();
        if c.is_none() && eof {
            self.fall_back();
        }
        c
    }

    pub(super) fn starts(&self, lit: &str, eof: bool) -> Lit {
        if self.buf.starts_with(lit) {
            Lit::Yes
        } else if !eof && lit.starts_with(self.buf.as_str()) {
            Lit::More
        } else {
            Lit::No
        }
    }

    /// Consumes `n` bytes (a char boundary) into the held raw text.
    pub(super) fn take(&mut self, n: usize) {
        let n = n.min(self.buf.len());
        self.raw.extend(self.buf.drain(..n));
    }

    /// Drops the consumed text: it was structure around calls already sent.
    pub(super) fn settle(&mut self) {
        self.raw.clear();
    }

    /// Reads and sends one call: see [`Core::read_call`].
    pub(super) fn take_call(&mut self, name: Option<&str>, eof: bool) -> bool {
        let read = self.read_call(name, eof);
        if read {
            self.send_pending();
        }
        read
    }

    /// Reads one call after optional whitespace, to send later with [`Core::send_pending`]: a JSON
    /// object that is the call itself, or with `name` given, the call's arguments object. True
    /// when the call was read; false when more text is needed or the call failed (then everything
    /// became content).
    pub(super) fn read_call(&mut self, name: Option<&str>, eof: bool) -> bool {
        self.skip_ws();
        match self.peek() {
            Some('{') => {}
            None if !eof => return false,
            _ => {
                self.fall_back();
                return false;
            }
        }
        let Some(end) = json_value_end(&self.buf, 0) else {
            if eof {
                self.fall_back();
            }
            return false;
        };
        let value = serde_json::from_str::<Value>(&self.buf[..end]);
        self.take(end);
        let call = value.ok().and_then(|value| match name {
            Some(name) => value
                .is_object()
                .then(|| call_from_parts(name, Some(&value), &self.known))
                .flatten(),
            None => call_from_object(&value, &self.known),
        });
        match call {
            Some(call) => {
                self.pending = Some(call);
                true
            }
            None => {
                self.fall_back();
                false
            }
        }
    }

    /// Sends the call read last; the text it was read from is dropped.
    pub(super) fn send_pending(&mut self) {
        if let Some(call) = self.pending.take() {
            self.call(call);
        }
    }

    fn call(&mut self, call: ToolCall) {
        let index = self.calls;
        self.events.push(StreamEvent::CallStart {
            index,
            name: call.name,
        });
        self.events.push(StreamEvent::Arguments {
            index,
            text: call.arguments,
        });
        self.calls += 1;
        self.raw.clear();
        self.segment_sent = false;
    }

    /// The text is not (or no longer) calls: send everything held, and all that follows, as is.
    pub(super) fn fall_back(&mut self) {
        self.fell_back = true;
        self.pending = None;
        self.plain();
    }

    /// The output is plain text (not a failure): send it all as is.
    pub(super) fn plain(&mut self) {
        self.verbatim = true;
        let raw = std::mem::take(&mut self.raw);
        let buf = std::mem::take(&mut self.buf);
        self.emit(&raw);
        self.emit(&buf);
    }

    /// Content-segment text: whitespace waits in `raw` until the segment shows real text.
    fn content(&mut self, text: &str) {
        if self.segment_sent {
            self.emit(text);
        } else if text.trim().is_empty() {
            self.raw.push_str(text);
        } else {
            let pending = std::mem::take(&mut self.raw);
            self.emit(&pending);
            self.emit(text);
            self.segment_sent = true;
        }
    }

    fn emit(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        if let Some(StreamEvent::Content(last)) = self.events.last_mut() {
            last.push_str(text);
        } else {
            self.events.push(StreamEvent::Content(text.to_owned()));
        }
    }
}
