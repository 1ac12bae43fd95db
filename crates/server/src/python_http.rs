//! `rserve._core.HttpApp`: the server's router (every OpenAI route, the same parsing, errors and
//! streaming) over an engine loaded in this process, called request by request with no socket.
//! What a Python web framework (Ray Serve's proxy, an ASGI app) puts in front of the in-process
//! engine to serve the same API as `rserve serve`.

use crate::openai::tools::ToolParser;
use crate::routes::{router, AppState, EdgeConfig};
use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, Method, Request};
use http_body_util::BodyExt;
use pyo3::exceptions::{PyRuntimeError, PyStopIteration, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use rserve_core::EngineHandle;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;
use tower::ServiceExt;

/// The router over one engine, with the runtime its handlers run on.
#[pyclass(frozen, name = "HttpApp", module = "rserve._core")]
pub struct PyHttpApp {
    app: axum::Router,
    rt: tokio::runtime::Runtime,
}

impl PyHttpApp {
    pub fn new(
        handle: EngineHandle,
        served_model_name: String,
        api_key: Option<String>,
        tool_call_parser: Option<&str>,
        media: crate::openai::media::MediaConfig,
    ) -> PyResult<Self> {
        let auto_tools = match tool_call_parser {
            None => None,
            Some(name) => Some(ToolParser::from_name(name.trim()).ok_or_else(|| {
                PyValueError::new_err(format!(
                    "unknown tool call parser `{name}`; available: {}",
                    ToolParser::NAMES.join(", ")
                ))
            })?),
        };
        if served_model_name.trim().is_empty() {
            return Err(PyValueError::new_err("served_model_name must not be empty"));
        }
        // the engine's media settings (`LLM(allowed_media_domains=...)`) hold for HTTP requests too
        let edge = EdgeConfig {
            auto_tools,
            media,
            ..EdgeConfig::default()
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("rserve-http")
            .enable_all()
            .build()
            .map_err(|e| PyRuntimeError::new_err(format!("starting the HTTP runtime: {e}")))?;
        let state = Arc::new(AppState::new(served_model_name, api_key, edge));
        state.set_engine(handle);
        Ok(Self {
            app: router(state),
            rt,
        })
    }
}

fn bad_request(what: &str, e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("invalid {what}: {e}"))
}

/// Response headers as (name, value) pairs.
type Headers = Vec<(String, String)>;

/// What a running request reports, in order: the head, then the body's chunks.
enum Event {
    Head(u16, Headers),
    Chunk(Vec<u8>),
    Failed(String),
}

/// Runs `req` through `app`, sending the head and then each body chunk; stops early (dropping
/// the body) once the receiver is gone.
async fn run(app: axum::Router, req: Request<Body>, tx: mpsc::Sender<Event>) {
    let resp = match app.oneshot(req).await {
        Ok(r) => r,
        Err(never) => match never {},
    };
    let headers = resp
        .headers()
        .iter()
        .filter_map(|(k, v)| Some((k.as_str().to_string(), v.to_str().ok()?.to_string())))
        .collect();
    if tx
        .send(Event::Head(resp.status().as_u16(), headers))
        .is_err()
    {
        return;
    }
    let mut body = resp.into_body();
    while let Some(frame) = body.frame().await {
        let event = match frame {
            Ok(f) => match f.into_data() {
                Ok(data) if !data.is_empty() => Event::Chunk(data.to_vec()),
                _ => continue,
            },
            Err(e) => Event::Failed(e.to_string()),
        };
        let failed = matches!(event, Event::Failed(_));
        if tx.send(event).is_err() || failed {
            return;
        }
    }
}

#[pymethods]
impl PyHttpApp {
    /// Starts one request (path with its query string) and returns at once; its head and body
    /// come through the returned `HttpResponse`.
    #[pyo3(signature = (method, path, headers, body))]
    fn start(
        &self,
        method: &str,
        path: &str,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    ) -> PyResult<PyHttpResponse> {
        let method = Method::from_bytes(method.as_bytes()).map_err(|e| bad_request("method", e))?;
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .body(Body::from(body))
            .map_err(|e| bad_request("request", e))?;
        for (k, v) in headers {
            let name =
                HeaderName::from_bytes(k.as_bytes()).map_err(|e| bad_request("header", e))?;
            let value = HeaderValue::from_str(&v).map_err(|e| bad_request("header", e))?;
            req.headers_mut().append(name, value);
        }
        let (tx, rx) = mpsc::channel();
        let task = self.rt.spawn(run(self.app.clone(), req, tx));
        Ok(PyHttpResponse {
            rx: Mutex::new(Some(rx)),
            task: task.abort_handle(),
        })
    }
}

/// A request in flight. Dropping it (or `close`) before the end drops the response body, which
/// aborts a streamed generation as a client disconnect does.
#[pyclass(frozen, name = "HttpResponse", module = "rserve._core")]
pub struct PyHttpResponse {
    rx: Mutex<Option<mpsc::Receiver<Event>>>,
    task: tokio::task::AbortHandle,
}

impl PyHttpResponse {
    /// Waits (GIL released) up to `timeout_s` for the next event; Ok(None) on timeout.
    fn next_event(&self, py: Python<'_>, timeout_s: f64) -> PyResult<Option<Event>> {
        if !(timeout_s >= 0.0 && timeout_s.is_finite()) {
            return Err(PyValueError::new_err(
                "timeout_s must be a finite number of seconds",
            ));
        }
        let timeout = Duration::from_secs_f64(timeout_s.min(3600.0));
        py.detach(|| {
            let mut g = self
                .rx
                .lock()
                .map_err(|_| PyRuntimeError::new_err("response lock poisoned"))?;
            let Some(rx) = g.as_ref() else {
                return Err(PyStopIteration::new_err(()));
            };
            match rx.recv_timeout(timeout) {
                Ok(e) => Ok(Some(e)),
                Err(mpsc::RecvTimeoutError::Timeout) => Ok(None),
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    g.take();
                    Err(PyStopIteration::new_err(()))
                }
            }
        })
    }
}

impl Drop for PyHttpResponse {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[pymethods]
impl PyHttpResponse {
    /// The status and headers, or `None` when they did not come within `timeout_s`. Call until
    /// it returns them, then `next_chunk`.
    fn head(&self, py: Python<'_>, timeout_s: f64) -> PyResult<Option<(u16, Headers)>> {
        match self.next_event(py, timeout_s) {
            Ok(None) => Ok(None),
            Ok(Some(Event::Head(status, headers))) => Ok(Some((status, headers))),
            Ok(Some(Event::Failed(e))) => Err(PyRuntimeError::new_err(e)),
            Ok(Some(Event::Chunk(_))) => Err(PyRuntimeError::new_err("the head was taken")),
            Err(e) if e.is_instance_of::<PyStopIteration>(py) => Err(PyRuntimeError::new_err(
                "the request ended without a response",
            )),
            Err(e) => Err(e),
        }
    }

    /// The next body chunk, `None` when none came within `timeout_s`; StopIteration at the end.
    fn next_chunk<'py>(
        &self,
        py: Python<'py>,
        timeout_s: f64,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        match self.next_event(py, timeout_s)? {
            None => Ok(None),
            Some(Event::Chunk(b)) => Ok(Some(PyBytes::new(py, &b))),
            Some(Event::Failed(e)) => Err(PyRuntimeError::new_err(format!("response body: {e}"))),
            Some(Event::Head(..)) => Err(PyRuntimeError::new_err("call head() first")),
        }
    }

    /// Drops the rest of the response (aborts a streamed generation).
    fn close(&self) {
        self.task.abort();
        if let Ok(mut g) = self.rx.lock() {
            g.take();
        }
    }
}
