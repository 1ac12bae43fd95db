//! The adapters callers can name: name -> [`AdapterId`], where each was read from, and the
//! adapters kept in host memory (at most `--max-cpu-loras`, least recently used dropped first and
//! read again from their directory when next asked for).
//!
//! Shared by every caller of the engine (HTTP handlers, Python) behind a lock; reading an adapter
//! from disk happens outside the lock, on the caller's thread, never on the engine thread. The
//! engine only ever sees an [`AdapterId`] with the adapter's matrices ([`ResolvedLora`]), which a
//! request holds until it ends: unloading a name stops new requests from using it while requests
//! in flight finish with it.

use super::peft::{BaseShape, LoraAdapter};
use super::{AdapterId, LoraOptions};
use crate::engine_error::EngineError;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// An adapter ready for a request (two are equal when their ids are).
#[derive(Debug, Clone)]
pub struct ResolvedLora {
    pub id: AdapterId,
    pub adapter: Arc<LoraAdapter>,
}

impl PartialEq for ResolvedLora {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}

/// What `/v1/models` and `rserve adapters` tell of a registered adapter.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterInfo {
    pub name: String,
    pub id: AdapterId,
    pub path: PathBuf,
    /// Unix seconds of its registration.
    pub created: u64,
}

struct Entry {
    id: AdapterId,
    path: PathBuf,
    created: u64,
    data: Option<Arc<LoraAdapter>>,
    last_used: u64,
}

#[derive(Default)]
struct Inner {
    by_name: HashMap<String, Entry>,
    next_id: u32,
    tick: u64,
}

/// The registered adapters.
pub struct LoraRegistry {
    opts: LoraOptions,
    base: BaseShape,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for LoraRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoraRegistry")
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl LoraRegistry {
    pub fn new(opts: LoraOptions, base: BaseShape) -> Self {
        Self {
            opts,
            base,
            inner: Mutex::new(Inner::default()),
        }
    }

    pub fn options(&self) -> &LoraOptions {
        &self.opts
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Inner>, EngineError> {
        self.inner
            .lock()
            .map_err(|_| EngineError::Model("the LoRA registry is poisoned".into()))
    }

    /// Reads an adapter directory (or a hub id) and checks it against the base.
    fn read(&self, name: &str, path: &Path) -> Result<LoraAdapter, EngineError> {
        let dir = crate::hub::resolve_model(&path.to_string_lossy())
            .map_err(|e| EngineError::Lora(format!("LoRA adapter `{name}`: {e}")))?;
        LoraAdapter::load(name, &dir, &self.base, self.opts.max_rank)
            .map_err(|e| EngineError::Lora(e.to_string()))
    }

    /// Registers `name` from `path` (read and checked now). A name already registered is an
    /// error, as is an adapter that cannot be used.
    pub fn load(&self, name: &str, path: &Path) -> Result<AdapterId, EngineError> {
        if name.is_empty() {
            return Err(EngineError::Lora("a LoRA adapter needs a name".into()));
        }
        if self.lock()?.by_name.contains_key(name) {
            return Err(EngineError::Lora(format!(
                "a LoRA adapter named `{name}` is already loaded"
            )));
        }
        let adapter = Arc::new(self.read(name, path)?);
        let mut g = self.lock()?;
        if g.by_name.contains_key(name) {
            return Err(EngineError::Lora(format!(
                "a LoRA adapter named `{name}` is already loaded"
            )));
        }
        g.next_id += 1;
        g.tick += 1;
        let id = AdapterId(g.next_id);
        let entry = Entry {
            id,
            path: path.to_path_buf(),
            created: now_secs(),
            data: Some(adapter),
            last_used: g.tick,
        };
        g.by_name.insert(name.to_owned(), entry);
        Self::trim(&mut g, self.opts.max_cpu_loras);
        Ok(id)
    }

    /// Forgets `name`: new requests cannot use it; requests holding it finish with it.
    pub fn unload(&self, name: &str) -> Result<AdapterId, EngineError> {
        self.lock()?
            .by_name
            .remove(name)
            .map(|e| e.id)
            .ok_or_else(|| EngineError::NotFound(format!("no LoRA adapter named `{name}`")))
    }

    /// The adapter `name` for a request, read again from its directory if it left host memory.
    pub fn resolve(&self, name: &str) -> Result<ResolvedLora, EngineError> {
        let (id, path) = match self.lookup(name)? {
            Ok(held) => return Ok(held),
            Err(gone) => gone,
        };
        let adapter = Arc::new(self.read(name, &path)?);
        let mut g = self.lock()?;
        if let Some(e) = g.by_name.get_mut(name).filter(|e| e.id == id) {
            e.data = Some(adapter.clone());
        }
        Self::trim(&mut g, self.opts.max_cpu_loras);
        Ok(ResolvedLora { id, adapter })
    }

    /// The adapter `name` if its matrices are in host memory (`None` when resolving it would
    /// read its directory), marked as used.
    pub fn resolve_in_memory(&self, name: &str) -> Result<Option<ResolvedLora>, EngineError> {
        Ok(self.lookup(name)?.ok())
    }

    /// Marks `name` used and gives its matrices if in host memory, else its id and directory.
    /// An unknown name is [`EngineError::NotFound`].
    fn lookup(
        &self,
        name: &str,
    ) -> Result<Result<ResolvedLora, (AdapterId, PathBuf)>, EngineError> {
        let mut g = self.lock()?;
        g.tick += 1;
        let tick = g.tick;
        let e = g
            .by_name
            .get_mut(name)
            .ok_or_else(|| EngineError::NotFound(format!("The model `{name}` does not exist.")))?;
        e.last_used = tick;
        Ok(match &e.data {
            Some(a) => Ok(ResolvedLora {
                id: e.id,
                adapter: a.clone(),
            }),
            None => Err((e.id, e.path.clone())),
        })
    }

    /// Drops the host copies of the least recently used adapters beyond `keep`.
    fn trim(g: &mut Inner, keep: usize) {
        loop {
            let held: Vec<(&String, u64)> = g
                .by_name
                .iter()
                .filter(|(_, e)| e.data.is_some())
                .map(|(n, e)| (n, e.last_used))
                .collect();
            if held.len() <= keep {
                return;
            }
            let Some(oldest) = held
                .iter()
                .min_by_key(|(_, t)| *t)
                .map(|(n, _)| (*n).clone())
            else {
                return;
            };
            if let Some(e) = g.by_name.get_mut(&oldest) {
                e.data = None;
            }
        }
    }

    /// Whether `name` is registered.
    pub fn contains(&self, name: &str) -> bool {
        self.lock().is_ok_and(|g| g.by_name.contains_key(name))
    }

    /// Every registered adapter, by name.
    pub fn list(&self) -> Vec<AdapterInfo> {
        let Ok(g) = self.lock() else {
            return Vec::new();
        };
        let mut v: Vec<AdapterInfo> = g
            .by_name
            .iter()
            .map(|(n, e)| AdapterInfo {
                name: n.clone(),
                id: e.id,
                path: e.path.clone(),
                created: e.created,
            })
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// Names of the adapters whose matrices are in host memory now.
    pub fn in_host_memory(&self) -> Vec<String> {
        let Ok(g) = self.lock() else {
            return Vec::new();
        };
        let mut v: Vec<String> = g
            .by_name
            .iter()
            .filter(|(_, e)| e.data.is_some())
            .map(|(n, _)| n.clone())
            .collect();
        v.sort();
        v
    }

    /// The name of a registered adapter id.
    pub fn name_of(&self, id: AdapterId) -> Option<String> {
        let g = self.lock().ok()?;
        g.by_name
            .iter()
            .find(|(_, e)| e.id == id)
            .map(|(n, _)| n.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../adapters/fixtures")
            .join(name)
    }

    /// The tiny llama3 fixture's shape, which the llama3 adapters fit.
    fn registry(max_cpu_loras: usize) -> LoraRegistry {
        let base = BaseShape {
            layers: 2,
            hidden: 64,
            intermediate: 128,
            q_out: 64,
            kv_out: 32,
        };
        let opts = LoraOptions {
            max_loras: 1,
            max_rank: 16,
            max_cpu_loras,
        };
        LoraRegistry::new(opts, base)
    }

    #[test]
    fn host_copies_beyond_the_limit_go_least_recently_used_first_and_come_back_on_use() {
        let r = registry(2);
        let names = ["a", "b", "c"];
        let dirs = ["llama3-r8-qv", "llama3-r4-all", "llama3-r16-rslora-mlp"];
        for (n, d) in names.iter().zip(dirs) {
            r.load(n, &fixture(d)).expect("loads");
        }
        // loading c dropped a, the least recently used
        assert_eq!(r.in_host_memory(), ["b", "c"]);
        assert!(r.resolve_in_memory("a").expect("known").is_none());
        // using b makes c the least recently used: reading a again drops c
        assert!(r.resolve_in_memory("b").expect("known").is_some());
        let a = r.resolve("a").expect("read again");
        assert_eq!(a.adapter.max_rank(), 8);
        assert_eq!(r.in_host_memory(), ["a", "b"]);
        // the same id as when it was loaded: slots and cache keys stay valid
        assert_eq!(
            Some(a.id),
            r.list().iter().find(|i| i.name == "a").map(|i| i.id)
        );
        assert!(matches!(
            r.resolve_in_memory("nope"),
            Err(EngineError::NotFound(_))
        ));
        assert!(matches!(r.resolve("nope"), Err(EngineError::NotFound(_))));
    }
}
