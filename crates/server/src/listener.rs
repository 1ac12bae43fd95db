//! The HTTP/1.1 connection loop. Bounds what a slow or idle client can hold: the request head
//! must arrive within `header_read_timeout` of the server starting to wait for it, an idle
//! keep-alive connection is closed after `keep_alive`, and request heads are limited in size.
//! On shutdown it stops accepting, closes idle connections and lets the others finish their
//! response.

use axum::body::Body;
use axum::extract::Request;
use axum::Router;
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tower::ServiceExt;

/// Per-connection limits.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// From when the server waits for a request head until the head is complete.
    pub header_read_timeout: Duration,
    /// How long a connection may sit idle between requests.
    pub keep_alive: Duration,
    /// hyper's own cap on a request head in bytes; heads above `routes::MAX_HEADER_BYTES` but
    /// below this get a JSON 431 from the router, heads above it hyper's bare 431.
    pub max_head_bytes: usize,
    /// hyper's cap on the number of header fields (likewise above the router's).
    pub max_headers: usize,
}

/// What one connection is doing: requests in progress, and since when it has been idle.
#[derive(Debug)]
struct Activity {
    active: AtomicUsize,
    idle_since: Mutex<Instant>,
    /// Bytes arrived since the connection went idle (a request head is on its way: hyper's
    /// header timeout governs it then).
    read_since_idle: AtomicBool,
}

impl Activity {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            active: AtomicUsize::new(0),
            idle_since: Mutex::new(Instant::now()),
            read_since_idle: AtomicBool::new(false),
        })
    }

    fn begin(self: &Arc<Self>) -> Busy {
        self.active.fetch_add(1, Ordering::AcqRel);
        Busy(self.clone())
    }

    /// When the keep-alive clock runs out, if the connection is idle now.
    fn idle_deadline(&self, keep_alive: Duration) -> Option<Instant> {
        if self.active.load(Ordering::Acquire) > 0 || self.read_since_idle.load(Ordering::Acquire) {
            return None;
        }
        let since = *self.idle_since.lock().unwrap_or_else(|p| p.into_inner());
        Some(since + keep_alive)
    }
}

/// Held while a request is in progress, until its response body is done.
struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        if self.0.active.fetch_sub(1, Ordering::AcqRel) == 1 {
            *self.0.idle_since.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
            self.0.read_since_idle.store(false, Ordering::Release);
        }
    }
}

/// A response body that keeps its connection busy until it is sent or dropped.
struct BusyBody {
    inner: Body,
    _busy: Busy,
}

impl HttpBody for BusyBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The socket, noting when bytes arrive.
struct Watched {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.read_since_idle.store(true, Ordering::Release);
        }
        r
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Live connections, and a wake-up when the last one ends.
#[derive(Default)]
struct Live {
    count: AtomicUsize,
    gone: Notify,
}

/// One live connection; counted out when its task ends, however it ends.
struct LiveGuard(Arc<Live>);

impl LiveGuard {
    fn new(live: &Arc<Live>) -> Self {
        live.count.fetch_add(1, Ordering::AcqRel);
        Self(live.clone())
    }
}

impl Drop for LiveGuard {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.gone.notify_waiters();
        }
    }
}

async fn connection(
    sock: TcpStream,
    app: Router,
    limits: ConnLimits,
    mut stop: watch::Receiver<bool>,
) {
    let _ = sock.set_nodelay(true);
    let activity = Activity::new();
    let io = TokioIo::new(Watched {
        inner: sock,
        activity: activity.clone(),
    });
    let act = activity.clone();
    let svc = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let busy = act.begin();
        let app = app.clone();
        async move {
            let resp = app.oneshot(Request::from(req.map(Body::new))).await?;
            Ok::<_, std::convert::Infallible>(resp.map(|b| {
                Body::new(BusyBody {
                    inner: b,
                    _busy: busy,
                })
            }))
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(limits.max_head_bytes.max(8192))
        .max_headers(limits.max_headers)
        .keep_alive(true);
    let conn = builder.serve_connection(io, svc);
    tokio::pin!(conn);
    let mut closing = *stop.borrow();
    if closing {
        conn.as_mut().graceful_shutdown();
    }
    loop {
        let deadline = activity.idle_deadline(limits.keep_alive);
        let wake = deadline.unwrap_or_else(|| Instant::now() + limits.keep_alive);
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!("connection ended: {e}");
                }
                return;
            }
            changed = stop.changed(), if !closing => {
                if changed.is_err() || *stop.borrow() {
                    closing = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
            _ = tokio::time::sleep_until(wake.into()), if !closing => {
                if activity.idle_deadline(limits.keep_alive).is_some_and(|d| d <= Instant::now()) {
                    closing = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

/// Serves `app` on `listener` until `shutdown` completes, then waits for the connections to end.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let live = Arc::new(Live::default());
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((sock, _)) => {
                    let guard = LiveGuard::new(&live);
                    let (app, stop) = (app.clone(), stop_rx.clone());
                    tokio::spawn(async move {
                        let _guard = guard;
                        connection(sock, app, limits, stop).await;
                    });
                }
                Err(e) => {
                    // out of file descriptors and the like: back off instead of spinning
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = &mut shutdown => break,
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    loop {
        let gone = live.gone.notified();
        if live.count.load(Ordering::Acquire) == 0 {
            return Ok(());
        }
        gone.await;
    }
}
