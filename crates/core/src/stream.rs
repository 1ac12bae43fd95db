//! How a request's outputs travel from the engine thread to its reader: a coalescing mailbox.
//!
//! The engine posts [`RequestDelta`]s through a [`Sink`]; a delta the reader has not taken yet
//! absorbs the next one ([`RequestDelta::merge`]), and a doorbell channel of capacity one wakes
//! the reader. So whatever the reader's pace, a request holds at most one pending delta, never
//! more than its own output, and the engine never blocks on a reader. [`OutputStream`] takes the
//! deltas (async, blocking or with a timeout) and keeps the request's assembled
//! [`RequestOutput`] beside them. A reader that went away is seen by the engine at its next
//! post (the doorbell is disconnected); dropping an unfinished stream also aborts its request.

use crate::engine_error::EngineError;
use crate::request::{EngineRequest, RequestDelta, RequestId, RequestOutput};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[derive(Debug, Default)]
struct Slot {
    delta: Option<RequestDelta>,
    error: Option<EngineError>,
}

#[derive(Debug, Default)]
struct Mailbox {
    slot: Mutex<Slot>,
}

impl Mailbox {
    fn lock(&self) -> MutexGuard<'_, Slot> {
        // a panic while holding the lock leaves a consistent slot: take it as it is
        self.slot.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The pending delta, else the pending error.
    fn take(&self) -> Option<Result<RequestDelta, EngineError>> {
        let mut s = self.lock();
        if let Some(d) = s.delta.take() {
            return Some(Ok(d));
        }
        s.error.take().map(Err)
    }
}

/// The engine's end of a request's mailbox.
#[derive(Debug)]
pub struct Sink {
    mailbox: Arc<Mailbox>,
    bell: flume::Sender<()>,
}

impl Sink {
    /// Posts a delta, merged into any the reader has not taken; false when the reader is gone.
    pub fn post(&self, delta: RequestDelta) -> bool {
        {
            let mut s = self.mailbox.lock();
            match s.delta.as_mut() {
                Some(d) => d.merge(delta),
                None => s.delta = Some(delta),
            }
        }
        self.ring()
    }

    /// Ends the request with an error (after any pending delta); false when the reader is gone.
    pub fn fail(&self, err: EngineError) -> bool {
        self.mailbox.lock().error = Some(err);
        self.ring()
    }

    fn ring(&self) -> bool {
        !matches!(
            self.bell.try_send(()),
            Err(flume::TrySendError::Disconnected(()))
        )
    }
}

/// How a stream asks the engine to abort its request.
pub(crate) type AbortFn = Arc<dyn Fn(RequestId) + Send + Sync>;

/// A sink and the stream that reads it, for request `id`.
pub(crate) fn channel(id: RequestId, req: &EngineRequest, abort: AbortFn) -> (Sink, OutputStream) {
    let mailbox = Arc::new(Mailbox::default());
    let (bell, rx) = flume::bounded(1);
    let sink = Sink {
        mailbox: mailbox.clone(),
        bell,
    };
    let stream = OutputStream {
        id,
        mailbox,
        bell: rx,
        abort,
        done: false,
        output: RequestOutput::new(id, req.prompt_token_ids.clone(), &req.params),
    };
    (sink, stream)
}

/// A request's outputs as deltas, in order; the last has `finished == true`. The assembled
/// output so far is [`OutputStream::output`].
pub struct OutputStream {
    id: RequestId,
    mailbox: Arc<Mailbox>,
    bell: flume::Receiver<()>,
    abort: AbortFn,
    done: bool,
    output: RequestOutput,
}

/// One item of a stream: a delta, or the error that ended the request.
pub type StreamItem = Result<RequestDelta, EngineError>;

impl OutputStream {
    pub fn request_id(&self) -> RequestId {
        self.id
    }

    /// Everything received so far, assembled (each completion's `delta` is the last delta's text).
    pub fn output(&self) -> &RequestOutput {
        &self.output
    }

    fn see(&mut self, item: Option<StreamItem>) -> Option<StreamItem> {
        match &item {
            Some(Ok(d)) => {
                self.output.apply(d);
                if d.finished {
                    self.done = true;
                }
            }
            Some(Err(_)) | None => self.done = true,
        }
        item
    }

    /// What the mailbox holds now, or the end of a stream whose engine side is gone.
    fn poll(&mut self, bell_gone: bool) -> Option<Option<StreamItem>> {
        match self.mailbox.take() {
            Some(item) => Some(self.see(Some(item))),
            None if bell_gone => Some(self.see(None)),
            None => None,
        }
    }

    /// The next delta (async).
    pub async fn next(&mut self) -> Option<StreamItem> {
        while !self.done {
            if let Some(item) = self.poll(false) {
                return item;
            }
            let gone = self.bell.recv_async().await.is_err();
            if let Some(item) = self.poll(gone) {
                return item;
            }
        }
        None
    }

    /// The next delta (blocking; do not call from an async runtime thread).
    pub fn blocking_next(&mut self) -> Option<StreamItem> {
        while !self.done {
            if let Some(item) = self.poll(false) {
                return item;
            }
            let gone = self.bell.recv().is_err();
            if let Some(item) = self.poll(gone) {
                return item;
            }
        }
        None
    }

    /// The next delta, waiting at most `timeout` (blocking): `Err(())` on timeout.
    #[allow(clippy::result_unit_err)]
    pub fn next_timeout(&mut self, timeout: Duration) -> Result<Option<StreamItem>, ()> {
        let deadline = Instant::now().checked_add(timeout);
        while !self.done {
            if let Some(item) = self.poll(false) {
                return Ok(item);
            }
            let gone = match deadline {
                Some(d) => match self.bell.recv_deadline(d) {
                    Ok(()) => false,
                    Err(flume::RecvTimeoutError::Timeout) => return Err(()),
                    Err(flume::RecvTimeoutError::Disconnected) => true,
                },
                None => self.bell.recv().is_err(),
            };
            if let Some(item) = self.poll(gone) {
                return Ok(item);
            }
        }
        Ok(None)
    }

    /// Aborts the request (its final output still arrives, with finish reason `abort`).
    pub fn abort(&self) {
        (self.abort)(self.id);
    }

    /// Waits (blocking) for the end and returns the assembled output.
    pub fn wait(mut self) -> Result<RequestOutput, EngineError> {
        while let Some(item) = self.blocking_next() {
            item?;
        }
        if !self.output.finished {
            return Err(EngineError::Stopped);
        }
        Ok(self.into_output())
    }

    /// The assembled output, taken out of a stream that has ended.
    pub fn into_output(mut self) -> RequestOutput {
        self.take_output()
    }

    /// Moves the assembled output out (an empty one stays behind).
    pub fn take_output(&mut self) -> RequestOutput {
        std::mem::replace(
            &mut self.output,
            RequestOutput::new(self.id, Vec::new(), &Default::default()),
        )
    }
}

impl Drop for OutputStream {
    fn drop(&mut self) {
        if !self.done {
            (self.abort)(self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{CompletionDelta, SamplingParams};

    fn delta(text: &str, tokens: &[u32], finished: bool) -> RequestDelta {
        RequestDelta {
            request_id: RequestId(1),
            prompt_logprobs: Vec::new(),
            outputs: vec![CompletionDelta {
                index: 0,
                text: text.into(),
                token_ids: tokens.to_vec(),
                logprobs: Vec::new(),
                cumulative_logprob: -(tokens.len() as f32),
                finish_reason: finished.then_some(crate::request::FinishReason::Length),
                stop_reason: None,
            }],
            finished,
            queue_time: Some(0.5),
            num_cached_tokens: Some(3),
        }
    }

    fn pair() -> (Sink, OutputStream, std::sync::mpsc::Receiver<RequestId>) {
        let (tx, rx) = std::sync::mpsc::channel();
        let req = EngineRequest {
            prompt_token_ids: vec![1, 2],
            params: SamplingParams::default(),
            lora: None,
            cache_salt: None,
            mm: None,
        };
        let abort: AbortFn = Arc::new(move |id| {
            let _ = tx.send(id);
        });
        let (sink, stream) = channel(RequestId(1), &req, abort);
        (sink, stream, rx)
    }

    #[test]
    fn a_slow_reader_gets_one_merged_delta() {
        let (sink, mut stream, _rx) = pair();
        for i in 0..1000u32 {
            assert!(sink.post(delta("ab", &[i], false)));
        }
        assert!(sink.post(delta("!", &[7], true)));
        let d = stream.blocking_next().expect("item").expect("delta");
        assert_eq!(d.outputs.len(), 1);
        assert_eq!(d.outputs[0].token_ids.len(), 1001);
        assert_eq!(d.outputs[0].text.len(), 2001);
        assert!(d.finished);
        assert!(stream.blocking_next().is_none());
        let out = stream.output();
        assert_eq!(out.outputs[0].text.len(), 2001);
        assert_eq!(out.outputs[0].cumulative_logprob, -1.0);
        assert_eq!(out.queue_time, Some(0.5));
        assert_eq!(out.num_cached_tokens, Some(3));
    }

    #[test]
    fn deltas_assemble_and_errors_end_the_stream() {
        let (sink, mut stream, _rx) = pair();
        assert!(sink.post(delta("He", &[1], false)));
        assert_eq!(
            stream.next_timeout(Duration::from_secs(1)),
            Ok(Some(Ok(delta("He", &[1], false))))
        );
        assert_eq!(stream.next_timeout(Duration::from_millis(10)), Err(()));
        assert!(sink.post(delta("llo", &[2, 3], false)));
        assert!(sink.fail(EngineError::Model("boom".into())));
        assert!(matches!(stream.blocking_next(), Some(Ok(_))));
        assert!(matches!(stream.blocking_next(), Some(Err(_))));
        assert!(stream.blocking_next().is_none());
        assert_eq!(stream.output().outputs[0].text, "Hello");
        assert_eq!(stream.output().outputs[0].delta, "llo");
        assert_eq!(stream.output().outputs[0].token_ids, vec![1, 2, 3]);
    }

    #[test]
    fn the_engine_sees_a_reader_that_left_and_a_dropped_stream_aborts() {
        let (sink, stream, rx) = pair();
        drop(stream);
        assert_eq!(rx.try_recv(), Ok(RequestId(1)));
        assert!(!sink.post(delta("x", &[1], false)));
        let (sink, mut stream, _rx) = pair();
        drop(sink);
        assert!(stream.blocking_next().is_none());
        assert!(matches!(stream.wait(), Err(EngineError::Stopped)));
    }
}
