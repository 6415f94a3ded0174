//! The replica side of the data path: executes the peer requests an owner
//! sends to the components stored on this node's devices.
//!
//! Ordering: `handle` runs in arrival order for one connection and applies
//! writes (and fences) synchronously, so every replica applies an owner's
//! writes in the order the owner sent them. Durability (group commit) and
//! reads run afterwards, concurrently.

use crate::flusher::Flusher;
use crate::reader::Reader;
use crate::router::Router;
use bytes::Bytes;
use shoal_model::{ComponentId, DeviceId, Generation};
use shoal_owner::lease::Grants;
use shoal_rpc::{Handler, RegionSet, RemoteError, Reply, Request, Response};
use shoal_store::{StoreError, Tracked};

/// The component store the node runs on: the log-structured store
/// (`docs/store-log-format.md`).
pub type Store = shoal_store::LogStore;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use tokio::sync::watch;

/// Largest write applied on the async worker itself, in bytes: copying it
/// into the open batch takes microseconds; larger ones may fill and seal
/// batches (device writes), so they go to a blocking thread.
const INLINE_WRITE_MAX: usize = 64 << 10;

/// Region size of the dirty map (matches the owner's reconcile unit).
const REGION: u64 = shoal_owner::REGION;

// The store's marks (the dirty map's durable part) use the same regions.
const _: () = assert!(REGION == shoal_store::log::format::REGION_BLOCKS * 4096);

/// Sequence number of a dirty-map entry no barrier of its generation
/// clears: a region marked on the device before this node started. The
/// next owner's first barrier (sent once it reconciled the regions) clears
/// it.
const UNTIL_NEXT_OWNER: u64 = u64::MAX;

/// Regions that owners' writes may have left different between the copies.
#[derive(Default)]
struct Dirty {
    /// component → region → (generation, seq) of the newest write there
    /// not yet covered by a barrier.
    writes: HashMap<ComponentId, BTreeMap<u64, (Generation, u64)>>,
    /// component → regions marked on its device: the store's marks,
    /// mirrored so that a write to a marked region (nearly every write)
    /// does not take the store's lock a second time.
    marked: HashMap<ComponentId, HashSet<u64>>,
    /// component → (generation, seq) of the newest barrier that said
    /// `track`: an older one that did not (queued on a connection the
    /// owner has since replaced) must not empty the tracked set.
    tracked_at: HashMap<ComponentId, (Generation, u64)>,
    /// Components whose tracked set on the device may not be empty: a
    /// barrier without `track` takes the store's lock only for these
    /// (nearly every barrier finds nothing to empty).
    tracking: HashSet<ComponentId>,
}

pub struct Device {
    pub id: DeviceId,
    pub path: String,
    pub store: Arc<Store>,
    /// The device's group commit, on its own thread.
    pub flusher: Flusher,
    /// The device's reads, batched on threads of their own.
    pub reader: Reader,
    /// Bytes of data written to this device by owners (client writes and
    /// resync copies): the backend side of write amplification.
    pub written: std::sync::atomic::AtomicU64,
    /// Bytes owners copied into components here (writes and zeroings with
    /// `seq == 0`: resyncs, rebuilds and the reconciliation after a
    /// crash), zeroed ranges counted by their length.
    pub resync_written: std::sync::atomic::AtomicU64,
    /// Writes (and zeroings) made durable here, and the microseconds they
    /// took from arrival to durable: the replica's share of write latency.
    pub commits: std::sync::atomic::AtomicU64,
    pub commit_micros: std::sync::atomic::AtomicU64,
    /// Blocks found failing their checksum (by reads and the scrubber).
    pub checksum_errors: std::sync::atomic::AtomicU64,
    /// Bad blocks replaced with a good copy from another replica.
    pub repaired: std::sync::atomic::AtomicU64,
    /// Set once the store answered an I/O error (after a failed write or
    /// flush it refuses everything until reopened): reported `Failed`.
    pub io_failed: std::sync::atomic::AtomicBool,
    /// `used()` when a write was last refused for lack of space: reported
    /// `Full` until usage changes (`liveness::device_usage`).
    pub refused_at: Mutex<Option<u64>>,
}

impl Device {
    pub fn new(
        id: DeviceId,
        path: String,
        store: Arc<Store>,
        tuning: &crate::NodeTuning,
    ) -> std::io::Result<Device> {
        Ok(Device {
            id,
            flusher: Flusher::start(store.clone(), &format!("dev{id}"), tuning)?,
            reader: Reader::start(store.clone(), &format!("dev{id}"), tuning)?,
            path,
            store,
            written: Default::default(),
            resync_written: Default::default(),
            commits: Default::default(),
            commit_micros: Default::default(),
            checksum_errors: Default::default(),
            repaired: Default::default(),
            io_failed: Default::default(),
            refused_at: Default::default(),
        })
    }

    /// Counts a checksum failure in a store answer before passing it on,
    /// and records what an error says about the device itself (I/O error:
    /// failed; no space: full).
    /// Counts an owner's copy (`seq == 0`) of `len` bytes.
    fn count_copy(&self, seq: u64, len: u64) {
        if seq == 0 {
            self.resync_written
                .fetch_add(len, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn note<T>(&self, r: Result<T, StoreError>) -> Result<T, StoreError> {
        match &r {
            Err(StoreError::Checksum { .. }) => {
                self.checksum_errors
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            Err(StoreError::Io(_)) => self
                .io_failed
                .store(true, std::sync::atomic::Ordering::Relaxed),
            Err(StoreError::NoSpace) => {
                if let Ok(mut at) = self.refused_at.lock() {
                    *at = Some(self.store.used());
                }
            }
            _ => {}
        }
        r
    }
}

/// Keeps the owner's order between overlapping requests of a component
/// while non-overlapping ones run in parallel on blocking threads (so the
/// device sees many `O_DIRECT` writes at once). Every write and read
/// registers its range when it arrives (in connection order). A write
/// waits for the earlier overlapping writes and reads still running, so
/// that a read never sees a write (or trim) sent after it; a read waits
/// for the earlier overlapping writes only, so that it sees every write
/// sent before it while reads of one range still run side by side.
#[derive(Default)]
pub struct Sequencer {
    running: Mutex<HashMap<ComponentId, Vec<Running>>>,
    next: std::sync::atomic::AtomicU64,
}

struct Running {
    id: u64,
    start: u64,
    end: u64,
    /// A write (or trim): later reads wait for it too.
    write: bool,
    /// Done once it ran: a write's, made when it registers.
    done: Option<watch::Receiver<bool>>,
    /// Told once it ran: a read's, made only when a write comes to wait
    /// for it (most reads are never waited for, and cost no channel).
    wake: Option<watch::Sender<bool>>,
}

impl Running {
    /// What a later access waits on for this one.
    fn waited_on(&mut self) -> watch::Receiver<bool> {
        if let Some(rx) = &self.done {
            return rx.clone();
        }
        self.wake
            .get_or_insert_with(|| watch::channel(false).0)
            .subscribe()
    }
}

/// How a request takes its place in a component's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    /// Waits for earlier overlapping writes and reads; later overlapping
    /// writes and reads wait for it.
    Write,
    /// Waits for earlier overlapping writes; later overlapping writes wait
    /// for it.
    Read,
    /// Waits for earlier overlapping writes; nothing waits for it (a
    /// whole-component answer: allocated ranges, a digest).
    Look,
}

/// Held while a write or read runs; dropping it releases the accesses
/// behind it.
pub struct SeqGuard {
    seq: Arc<Sequencer>,
    component: ComponentId,
    id: u64,
    /// A write's: its `done`.
    tx: Option<watch::Sender<bool>>,
}

impl Drop for SeqGuard {
    fn drop(&mut self) {
        let mut woken = None;
        if let Ok(mut m) = self.seq.running.lock() {
            if let Some(v) = m.get_mut(&self.component) {
                if let Some(i) = v.iter().position(|r| r.id == self.id) {
                    woken = v.swap_remove(i).wake;
                }
                if v.is_empty() {
                    m.remove(&self.component);
                }
            }
        }
        if let Some(w) = woken {
            let _ = w.send(true);
        }
        if let Some(tx) = &self.tx {
            let _ = tx.send(true);
        }
    }
}

impl Sequencer {
    /// What an access of `[start, end)` waits for (see [`Access`]), and
    /// its registration, held while it runs, unless it is a look.
    fn enter(
        self: &Arc<Self>,
        component: ComponentId,
        start: u64,
        end: u64,
        access: Access,
    ) -> (Vec<watch::Receiver<bool>>, Option<SeqGuard>) {
        let Ok(mut m) = self.running.lock() else {
            return (Vec::new(), None);
        };
        let v = m.entry(component).or_default();
        let deps = v
            .iter_mut()
            .filter(|r| r.start < end && start < r.end && (r.write || access == Access::Write))
            .map(Running::waited_on)
            .collect();
        let guard = (access != Access::Look).then(|| {
            let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let write = access == Access::Write;
            let (tx, done) = match write {
                true => {
                    let (tx, rx) = watch::channel(false);
                    (Some(tx), Some(rx))
                }
                false => (None, None),
            };
            v.push(Running {
                id,
                start,
                end,
                write,
                done,
                wake: None,
            });
            SeqGuard {
                seq: self.clone(),
                component,
                id,
                tx,
            }
        });
        (deps, guard)
    }
}

async fn wait_all(deps: Vec<watch::Receiver<bool>>) {
    for mut r in deps {
        while !*r.borrow_and_update() {
            if r.changed().await.is_err() {
                break;
            }
        }
    }
}

/// All components on this node's devices.
pub struct Replicas {
    seq: Arc<Sequencer>,
    /// Devices come and go while the node runs (`crate::devices`).
    devices: std::sync::RwLock<HashMap<DeviceId, Arc<Device>>>,
    /// Which device holds each component.
    placement: Mutex<HashMap<ComponentId, DeviceId>>,
    /// Regions owners' writes may have left different between the
    /// copies, and their marks on the devices.
    dirty: Mutex<Dirty>,
    /// Set once the node's router exists; serves forwarded volume I/O.
    pub router: OnceLock<Arc<Router>>,
    /// Requests being served now (all devices): a write alone in flight
    /// syncs on its own thread ([`Flusher::commit_or_sync`]).
    in_flight: Arc<AtomicUsize>,
    /// The read leases granted to owners, per component (in memory).
    leases: Grants,
}

/// Counts a request in [`Replicas::in_flight`] until dropped.
struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

fn remote(e: StoreError) -> RemoteError {
    match e {
        StoreError::NoSpace => RemoteError::NoSpace,
        StoreError::OutOfRange { .. } => RemoteError::OutOfRange,
        StoreError::NoSuchComponent(c) => RemoteError::NoSuchComponent(c),
        StoreError::StaleGeneration { have, got } => RemoteError::StaleGeneration { have, got },
        StoreError::Io(e) => RemoteError::Io(e.to_string()),
        // A block whose checksum disagrees: the owner reads it from another
        // copy and sends it back with a repair.
        StoreError::Checksum { offset, .. } => RemoteError::Checksum { offset },
        e @ StoreError::DamagedInTransit { .. } => RemoteError::BadRequest(e.to_string()),
        other => RemoteError::Io(other.to_string()),
    }
}

fn done(r: Result<Response, RemoteError>) -> Reply {
    let resp = r.unwrap_or_else(Response::Err);
    Box::pin(async move { (resp, Bytes::new()) })
}

impl Replicas {
    pub fn new(devices: Vec<Device>) -> Replicas {
        let r = Replicas {
            seq: Arc::default(),
            devices: Default::default(),
            placement: Default::default(),
            dirty: Default::default(),
            router: OnceLock::new(),
            in_flight: Arc::default(),
            leases: Grants::new(std::time::Instant::now()),
        };
        for d in devices {
            r.add_device(d);
        }
        r
    }

    /// Serves the components of `d` from now on (at start, or a device
    /// added while the node runs). Regions marked on it had writes in
    /// flight when this node last stopped: dirty until the next owner
    /// reconciles.
    pub fn add_device(&self, d: Device) {
        {
            let mut placement = self.placement.lock().unwrap_or_else(|e| e.into_inner());
            let mut dirty = self.dirty.lock().unwrap_or_else(|e| e.into_inner());
            for c in d.store.components() {
                placement.insert(c.id, d.id);
                let empty = shoal_store::Tracked::Regions(Vec::new());
                if d.store.tracked_regions(c.id).is_some_and(|t| t != empty) {
                    dirty.tracking.insert(c.id);
                }
            }
            for (c, regions) in d.store.marked_regions() {
                let regions = regions.into_iter().map(u64::from);
                let e = dirty.writes.entry(c).or_default();
                e.extend(regions.clone().map(|r| (r, (0, UNTIL_NEXT_OWNER))));
                dirty.marked.entry(c).or_default().extend(regions);
            }
        }
        self.devices_mut().insert(d.id, Arc::new(d));
    }

    /// Stops serving device `id` and gives it back (None if it is not
    /// here). Its components are forgotten: the caller removes a device
    /// only once the directory places none there. Requests already at
    /// the device finish on it (they hold it).
    pub fn remove_device(&self, id: DeviceId) -> Option<Arc<Device>> {
        let d = self.devices_mut().remove(&id)?;
        self.placement
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|_, dev| *dev != id);
        Some(d)
    }

    fn devices_mut(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<DeviceId, Arc<Device>>> {
        self.devices.write().unwrap_or_else(|e| e.into_inner())
    }

    fn devices_ref(&self) -> std::sync::RwLockReadGuard<'_, HashMap<DeviceId, Arc<Device>>> {
        self.devices.read().unwrap_or_else(|e| e.into_inner())
    }

    /// The devices served now.
    pub fn devices(&self) -> Vec<Arc<Device>> {
        self.devices_ref().values().cloned().collect()
    }

    /// Device `id`, if it is served here.
    pub fn device(&self, id: DeviceId) -> Option<Arc<Device>> {
        self.devices_ref().get(&id).cloned()
    }

    /// Regions of this node's components written and not yet covered by a
    /// barrier (what a copy coming back after a cut would report as
    /// possibly different).
    pub fn unsettled_regions(&self) -> u64 {
        let m = self.dirty.lock().unwrap_or_else(|e| e.into_inner());
        m.writes.values().map(|r| r.len() as u64).sum()
    }

    /// Components stored here, with their volume ids.
    pub fn components(&self) -> Vec<(ComponentId, u64, DeviceId)> {
        let mut v = Vec::new();
        for d in self.devices() {
            for c in d.store.components() {
                v.push((c.id, c.volume, d.id));
            }
        }
        v
    }

    fn device_of(&self, c: ComponentId) -> Result<Arc<Device>, RemoteError> {
        let id = self
            .placement
            .lock()
            .map_err(|_| RemoteError::Io("poisoned".into()))?
            .get(&c)
            .copied()
            .ok_or(RemoteError::NoSuchComponent(c))?;
        self.device(id).ok_or(RemoteError::NoSuchDevice(id))
    }

    /// Refuses older generations; adopts a newer one (persisted).
    fn fence(&self, d: &Device, c: ComponentId, gen: Generation) -> Result<(), RemoteError> {
        let have = d
            .store
            .generation(c)
            .ok_or(RemoteError::NoSuchComponent(c))?;
        if gen < have {
            return Err(RemoteError::StaleGeneration { have, got: gen });
        }
        if gen > have {
            d.store.fence(c, gen).map_err(remote)?;
        }
        Ok(())
    }

    /// A read's generation check, which changes nothing: an older
    /// generation is stale, a newer one has not activated this copy (an
    /// owner activates every copy before it reads), so it is refused too.
    fn check_read(&self, d: &Device, c: ComponentId, gen: Generation) -> Result<(), RemoteError> {
        let have = d
            .store
            .generation(c)
            .ok_or(RemoteError::NoSuchComponent(c))?;
        match gen.cmp(&have) {
            std::cmp::Ordering::Less => Err(RemoteError::StaleGeneration { have, got: gen }),
            std::cmp::Ordering::Equal => Ok(()),
            std::cmp::Ordering::Greater => Err(RemoteError::Unavailable(format!(
                "component {c} is not activated under generation {gen} (it is at {have})"
            ))),
        }
    }

    /// Records the regions an owner's write touches as dirty until a
    /// barrier covers it: in memory (for the next owner, if this one dies)
    /// and marked on the device (for a restart of this node, if every node
    /// dies), before the write is applied, so the mark is durable no later
    /// than the write. Under the dirty map's lock, so that
    /// [`settle_marks`](Self::settle_marks) never unmarks a region a write
    /// has just made dirty.
    fn mark_dirty(
        &self,
        d: &Device,
        c: ComponentId,
        off: u64,
        len: u64,
        gen: Generation,
        seq: u64,
    ) -> Result<(), RemoteError> {
        if seq == 0 || len == 0 {
            return Ok(());
        }
        let mut m = self.dirty.lock().unwrap_or_else(|e| e.into_inner());
        let Dirty { writes, marked, .. } = &mut *m;
        let (e, marked) = (writes.entry(c).or_default(), marked.entry(c).or_default());
        let (first, end) = (off / REGION, off.saturating_add(len).div_ceil(REGION));
        let mut unmarked = false;
        for r in first..end {
            let v = e.entry(r).or_insert((gen, seq));
            *v = (*v).max((gen, seq));
            unmarked |= !marked.contains(&r);
        }
        if unmarked {
            d.note(d.store.mark_regions(c, off, len)).map_err(remote)?;
            marked.extend(first..end);
        }
        Ok(())
    }

    /// Unmarks on the devices the regions no longer dirty (a barrier
    /// covered their writes). Called now and then, not at every barrier:
    /// a busy region then stays marked instead of being marked and
    /// unmarked over and over.
    pub fn settle_marks(&self) {
        let mut m = self.dirty.lock().unwrap_or_else(|e| e.into_inner());
        let Dirty { writes, marked, .. } = &mut *m;
        for d in self.devices() {
            for (c, regions) in d.store.marked_regions() {
                let dirty = writes.get(&c);
                let clean: Vec<u32> = regions
                    .into_iter()
                    .filter(|&r| dirty.is_none_or(|e| !e.contains_key(&u64::from(r))))
                    .collect();
                match d.store.unmark_regions(c, &clean) {
                    Ok(()) => {
                        if let Some(set) = marked.get_mut(&c) {
                            for r in &clean {
                                set.remove(&u64::from(*r));
                            }
                        }
                    }
                    Err(e) => tracing::warn!(component = c, "unmarking settled regions: {e}"),
                }
            }
        }
    }

    /// Settles the writes older than `upto`, which are complete on every
    /// copy in service. With `track` (a copy is out of service), their
    /// regions are tracked on the device first, so a returning copy gets
    /// them; regions that cannot be tracked stay dirty, and are reported
    /// to it all the same. Without, every copy is in sync: nothing is
    /// tracked any more.
    fn barrier(&self, d: &Device, c: ComponentId, upto: (Generation, u64), track: bool) {
        let mut m = self.dirty.lock().unwrap_or_else(|e| e.into_inner());
        let newest_track = m.tracked_at.get(&c).copied();
        if track {
            let newest = newest_track.map_or(upto, |t| t.max(upto));
            m.tracked_at.insert(c, newest);
        } else if newest_track.is_none_or(|t| t <= upto) && m.tracking.contains(&c) {
            match d.note(d.store.untrack_all(c)) {
                Ok(()) => {
                    m.tracking.remove(&c);
                }
                Err(e) => tracing::warn!(component = c, "emptying the tracked regions: {e}"),
            }
        }
        let Dirty {
            writes, tracking, ..
        } = &mut *m;
        let Some(e) = writes.get_mut(&c) else {
            return;
        };
        if track {
            let settled: Vec<u32> = e
                .iter()
                .filter(|(_, v)| **v < upto)
                .filter_map(|(r, _)| u32::try_from(*r).ok())
                .collect();
            if !settled.is_empty() {
                if let Err(err) = d.note(d.store.track_regions(c, &settled)) {
                    tracing::warn!(component = c, "tracking settled regions: {err}");
                    return;
                }
                tracking.insert(c);
            }
        }
        e.retain(|_, v| *v >= upto);
    }

    /// The regions a returning copy may lack: tracked, or dirty (a write
    /// no barrier covered yet, or marked on the device before this node
    /// started). A region only marked is not: its writes were settled by
    /// a barrier, which tracked them if a copy was out.
    fn tracked(&self, d: &Device, c: ComponentId) -> Result<RegionSet, RemoteError> {
        let m = self.dirty.lock().unwrap_or_else(|e| e.into_inner());
        let tracked = d
            .store
            .tracked_regions(c)
            .ok_or(RemoteError::NoSuchComponent(c))?;
        let Tracked::Regions(tracked) = tracked else {
            return Ok(RegionSet::All);
        };
        let dirty = m.writes.get(&c).into_iter().flat_map(|e| e.keys().copied());
        let all = tracked.into_iter().map(u64::from).chain(dirty);
        Ok(RegionSet::from_regions(all))
    }

    /// Adds `regions` (those within the component) to its tracked set.
    fn track(&self, d: &Device, c: ComponentId, regions: &RegionSet) -> Result<(), RemoteError> {
        let size = d
            .store
            .component(c)
            .ok_or(RemoteError::NoSuchComponent(c))?
            .size;
        if !regions.is_ordered() {
            return Err(RemoteError::BadRequest("regions out of order".into()));
        }
        let r = match regions {
            RegionSet::All => d.store.track_all(c),
            RegionSet::Runs(_) => {
                let v: Vec<u32> = regions
                    .regions(size.div_ceil(REGION))
                    .filter_map(|r| u32::try_from(r).ok())
                    .collect();
                d.store.track_regions(c, &v)
            }
        };
        d.note(r).map_err(remote)?;
        self.note_tracking(c);
        Ok(())
    }

    /// Component `c` may have a tracked set on its device now.
    fn note_tracking(&self, c: ComponentId) {
        let mut m = self.dirty.lock().unwrap_or_else(|e| e.into_inner());
        m.tracking.insert(c);
    }

    /// Runs `apply` once the earlier overlapping writes are done, releases
    /// the writes behind it, then waits for durability. Small writes only
    /// copy into the store's open batch: they run on the async worker, with
    /// no thread hand-off; large ones run on a blocking thread.
    fn apply_then_commit(
        &self,
        d: Arc<Device>,
        deps: Vec<watch::Receiver<bool>>,
        guard: Option<SeqGuard>,
        inline: bool,
        apply: impl FnOnce(&Device) -> Result<(), StoreError> + Send + 'static,
    ) -> Reply {
        let in_flight = self.in_flight.clone();
        let router = self.router.get().cloned();
        let quiet = move || {
            // Quiet: this is the only request of the node's peers, and at
            // most one NBD request of its own clients is waiting (this one).
            in_flight.load(Ordering::Relaxed) <= 1
                && router
                    .as_ref()
                    .is_none_or(|r| r.client_requests.load(Ordering::Relaxed) <= 1)
        };
        let arrived = std::time::Instant::now();
        let finish = move |d: &Device, r: Result<(), StoreError>| {
            let r = d.note(r);
            d.commits.fetch_add(1, Ordering::Relaxed);
            d.commit_micros
                .fetch_add(arrived.elapsed().as_micros() as u64, Ordering::Relaxed);
            match r {
                Ok(()) => (Response::Ok, Bytes::new()),
                Err(e) => (Response::Err(remote(e)), Bytes::new()),
            }
        };
        // A small write with nothing to wait for is applied now, in arrival
        // order, and takes its ticket; the flusher is woken only when the
        // future runs, after the rest of the burst read with this write was
        // applied too, so one sync covers the burst.
        let ready = deps.iter().all(|r| *r.borrow() || r.has_changed().is_err());
        if inline && ready {
            let r = apply(&d);
            drop(guard);
            let ticket = r.map(|()| d.flusher.ticket(None));
            return Box::pin(async move {
                let r = match ticket {
                    Ok(t) => d.flusher.wait(t, quiet()).await,
                    Err(e) => Err(e),
                };
                finish(&d, r)
            });
        }
        // Accepted now, in arrival order: the device's next sync waits a
        // moment for this write to be applied. Not a write that must wait
        // for earlier overlapping ones: every sync would wait for it.
        let applying = deps.is_empty().then(|| d.flusher.begin());
        Box::pin(async move {
            wait_all(deps).await;
            let r = if inline {
                let r = apply(&d);
                drop(guard);
                r
            } else {
                let d2 = d.clone();
                tokio::task::spawn_blocking(move || {
                    let r = apply(&d2);
                    drop(guard);
                    r
                })
                .await
                .unwrap_or_else(|e| Err(StoreError::Io(std::io::Error::other(e.to_string()))))
            };
            let r = match r {
                Ok(()) => d.flusher.commit_or_sync(quiet(), applying).await,
                Err(e) => Err(e),
            };
            finish(&d, r)
        })
    }

    /// Durable once the device's group commit completes.
    fn durable(d: Arc<Device>, resp: Response) -> Reply {
        Box::pin(async move {
            match d.note(d.flusher.commit().await) {
                Ok(()) => (resp, Bytes::new()),
                Err(e) => (Response::Err(remote(e)), Bytes::new()),
            }
        })
    }

    /// A write from an owner: fenced, recorded dirty, ordered after the
    /// overlapping writes sent before it, durable before the reply.
    fn write(
        &self,
        component: ComponentId,
        generation: Generation,
        offset: u64,
        seq: u64,
        payload: Bytes,
        apply: impl FnOnce(&Device, ComponentId, u64, &[u8]) -> Result<(), StoreError> + Send + 'static,
    ) -> Result<Reply, RemoteError> {
        let d = self.device_of(component)?;
        self.fence(&d, component, generation)?;
        self.mark_dirty(&d, component, offset, payload.len() as u64, generation, seq)?;
        d.written
            .fetch_add(payload.len() as u64, std::sync::atomic::Ordering::Relaxed);
        d.count_copy(seq, payload.len() as u64);
        let end = offset.saturating_add(payload.len() as u64);
        let (deps, guard) = self.seq.enter(component, offset, end, Access::Write);
        let inline = payload.len() <= INLINE_WRITE_MAX;
        // The store refuses a write that would take space promised to
        // other (reserved) components: see `crate::space`.
        Ok(self.apply_then_commit(d, deps, guard, inline, move |d| {
            apply(d, component, offset, &payload)
        }))
    }

    fn execute(&self, req: Request, payload: Bytes) -> Result<Reply, RemoteError> {
        Ok(match req {
            Request::Ping => done(Ok(Response::Ok)),
            Request::CreateComponent {
                component,
                volume,
                device,
                size,
            } => {
                let d = self
                    .device(device)
                    .ok_or(RemoteError::NoSuchDevice(device))?;
                // Component ids are never reused, and a move gives the
                // copy a new id: one already on another device here is
                // that device's, and a second, empty one beside it would
                // hide its data.
                let elsewhere = self
                    .placement
                    .lock()
                    .map_err(|_| RemoteError::Io("poisoned".into()))?
                    .get(&component)
                    .copied()
                    .filter(|&on| on != device);
                if let Some(on) = elsewhere {
                    return Err(RemoteError::Io(format!(
                        "component {component} is on device {on} of this node, not device \
                         {device}: not created twice"
                    )));
                }
                let before = d.store.component(component);
                d.store
                    .create_component(component, volume, size)
                    .map_err(remote)?;
                if before.is_none() {
                    self.leases.created(component, std::time::Instant::now());
                }
                // A copy created empty (or never activated since: the
                // create may have been durable without the track) lacks
                // every region: a resync must copy them all.
                if size > 0 && before.is_none_or(|c| c.generation == 0) {
                    d.note(d.store.track_all(component)).map_err(remote)?;
                    self.note_tracking(component);
                }
                self.placement
                    .lock()
                    .map_err(|_| RemoteError::Io("poisoned".into()))?
                    .insert(component, device);
                Self::durable(d, Response::Ok)
            }
            Request::DeleteComponent { component } => {
                let d = self.device_of(component)?;
                d.store.delete_component(component).map_err(remote)?;
                if let Ok(mut p) = self.placement.lock() {
                    p.remove(&component);
                }
                if let Ok(mut m) = self.dirty.lock() {
                    m.writes.remove(&component);
                    m.marked.remove(&component);
                    m.tracked_at.remove(&component);
                    m.tracking.remove(&component);
                }
                self.leases.forget(component);
                Self::durable(d, Response::Ok)
            }
            Request::ResizeComponent { component, size } => {
                let d = self.device_of(component)?;
                // Grows only: volumes never shrink, and an owner that
                // resizes on every activation (stripe columns) must not
                // undo a later owner's growth with its older size.
                d.store.grow_component(component, size).map_err(remote)?;
                Self::durable(d, Response::Ok)
            }
            Request::Activate {
                component,
                generation,
            } => {
                let d = self.device_of(component)?;
                self.fence(&d, component, generation)?;
                let dirty = self
                    .dirty
                    .lock()
                    .ok()
                    .and_then(|m| m.writes.get(&component).cloned())
                    .unwrap_or_default()
                    .keys()
                    .map(|r| (r * REGION, REGION))
                    .collect();
                let now = std::time::Instant::now();
                let lease_ms = self.leases.activate(component, generation, now);
                Self::durable(d, Response::Activated { dirty, lease_ms })
            }
            Request::Write {
                component,
                generation,
                offset,
                seq,
            } => self.write(component, generation, offset, seq, payload, |d, c, o, p| {
                d.store.write(c, o, p)
            })?,
            Request::WriteChecked {
                component,
                generation,
                offset,
                seq,
                crcs,
            } => self.write(
                component,
                generation,
                offset,
                seq,
                payload,
                move |d, c, o, p| d.store.write_checked(c, o, p, &crcs),
            )?,
            Request::WriteZeroes {
                component,
                generation,
                offset,
                len,
                seq,
            } => {
                let d = self.device_of(component)?;
                self.fence(&d, component, generation)?;
                self.mark_dirty(&d, component, offset, len, generation, seq)?;
                d.count_copy(seq, len);
                let end = offset.saturating_add(len);
                let (deps, guard) = self.seq.enter(component, offset, end, Access::Write);
                self.apply_then_commit(d, deps, guard, false, move |d| {
                    d.store.write_zeroes(component, offset, len)
                })
            }
            Request::TrimRanges {
                component,
                generation,
                ranges,
                seq,
            } => {
                let (first, end) = shoal_rpc::trim_span(&ranges).ok_or_else(|| {
                    RemoteError::BadRequest(format!(
                        "a trim of {} ranges: 1 to {}, none empty, in order and apart",
                        ranges.len(),
                        shoal_rpc::MAX_TRIM_RANGES
                    ))
                })?;
                let d = self.device_of(component)?;
                self.fence(&d, component, generation)?;
                // All of it or none: a range past the end refuses the whole.
                let size = d.store.component(component).map_or(0, |c| c.size);
                if end > size {
                    return Err(RemoteError::OutOfRange);
                }
                for &(offset, len) in &ranges {
                    self.mark_dirty(&d, component, offset, len, generation, seq)?;
                }
                d.count_copy(seq, ranges.iter().map(|r| r.1).sum());
                // Ordered with the writes to the span they cover.
                let (deps, guard) = self.seq.enter(component, first, end, Access::Write);
                self.apply_then_commit(d, deps, guard, false, move |d| {
                    for &(offset, len) in &ranges {
                        d.store.write_zeroes(component, offset, len)?;
                    }
                    Ok(())
                })
            }
            Request::Read {
                component,
                generation,
                offset,
                len,
            } => {
                let d = self.device_of(component)?;
                self.check_read(&d, component, generation)?;
                if len > shoal_rpc::MAX_PAYLOAD {
                    return Err(RemoteError::BadRequest("read too large".into()));
                }
                let end = offset.saturating_add(len as u64);
                // Registered until read: a trim sent after this read (an
                // erasure-coded owner's, once a block is destaged) never
                // zeroes the block under it.
                let (deps, guard) = self.seq.enter(component, offset, end, Access::Read);
                Box::pin(async move {
                    wait_all(deps).await;
                    let read = d.reader.read(component, offset, len as usize).await;
                    drop(guard);
                    match d.note(read) {
                        Ok(buf) => (Response::Data, buf),
                        Err(e) => (Response::Err(remote(e)), Bytes::new()),
                    }
                })
            }
            Request::Flush {
                component,
                generation,
            } => {
                let d = self.device_of(component)?;
                self.fence(&d, component, generation)?;
                Self::durable(d, Response::Ok)
            }
            Request::Usage { component } => {
                let d = self.device_of(component)?;
                let allocated_bytes = d.store.component(component).map_or(0, |m| m.allocated);
                done(Ok(Response::Usage { allocated_bytes }))
            }
            Request::AllocatedRanges { component } => {
                let d = self.device_of(component)?;
                let (deps, _) = self.seq.enter(component, 0, u64::MAX, Access::Look);
                Box::pin(async move {
                    wait_all(deps).await;
                    (
                        Response::Ranges(d.store.allocated_ranges(component)),
                        Bytes::new(),
                    )
                })
            }
            Request::Barrier {
                component,
                generation,
                seq,
                track,
            } => {
                let d = self.device_of(component)?;
                self.fence(&d, component, generation)?;
                self.barrier(&d, component, (generation, seq), track);
                done(Ok(Response::Ok))
            }
            Request::TrackedRegions { component } => {
                let d = self.device_of(component)?;
                done(self.tracked(&d, component).map(Response::Tracked))
            }
            Request::Track {
                component,
                generation,
                regions,
            } => {
                let d = self.device_of(component)?;
                self.fence(&d, component, generation)?;
                self.track(&d, component, &regions)?;
                Self::durable(d, Response::Ok)
            }
            Request::Digest { component } => {
                let d = self.device_of(component)?;
                let size = d
                    .store
                    .component(component)
                    .ok_or(RemoteError::NoSuchComponent(component))?
                    .size;
                let (deps, _) = self.seq.enter(component, 0, u64::MAX, Access::Look);
                Box::pin(async move {
                    wait_all(deps).await;
                    let r = tokio::task::spawn_blocking(move || {
                        let mut crc = 0u32;
                        let mut buf = vec![0u8; 1 << 20];
                        let mut off = 0;
                        while off < size {
                            let n = (size - off).min(buf.len() as u64) as usize;
                            d.store.read(component, off, &mut buf[..n])?;
                            crc = crc32c::crc32c_append(crc, &buf[..n]);
                            off += n as u64;
                        }
                        Ok::<_, StoreError>(crc)
                    })
                    .await;
                    match r {
                        Ok(Ok(crc)) => (Response::Digest { crc, size }, Bytes::new()),
                        Ok(Err(e)) => (Response::Err(remote(e)), Bytes::new()),
                        Err(e) => (Response::Err(RemoteError::Io(e.to_string())), Bytes::new()),
                    }
                })
            }
            Request::Repair {
                component,
                generation,
                offset,
            } => {
                let d = self.device_of(component)?;
                self.fence(&d, component, generation)?;
                let end = offset.saturating_add(payload.len() as u64);
                let (deps, guard) = self.seq.enter(component, offset, end, Access::Write);
                Box::pin(async move {
                    wait_all(deps).await;
                    let d2 = d.clone();
                    let r = tokio::task::spawn_blocking(move || {
                        let r = d2.store.repair_block(component, offset, &payload);
                        drop(guard);
                        r
                    })
                    .await
                    .unwrap_or_else(|e| Err(StoreError::Io(std::io::Error::other(e.to_string()))));
                    let r = match r {
                        Ok(done) => d.flusher.commit().await.map(|()| done),
                        Err(e) => Err(e),
                    };
                    match r {
                        Ok(done) => {
                            if done {
                                d.repaired
                                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                            (Response::Repaired(done), Bytes::new())
                        }
                        Err(e) => (Response::Err(remote(e)), Bytes::new()),
                    }
                })
            }
            Request::Renew {
                component,
                generation,
                lease_ms,
            } => {
                let d = self.device_of(component)?;
                if lease_ms > shoal_rpc::MAX_LEASE_MS {
                    return Err(RemoteError::BadRequest(format!(
                        "lease of {lease_ms} ms: at most {} ms",
                        shoal_rpc::MAX_LEASE_MS
                    )));
                }
                // Only the owner that activated this copy gets a lease; a
                // renewal changes no generation.
                self.check_read(&d, component, generation)?;
                let now = std::time::Instant::now();
                self.leases
                    .grant(component, generation, lease_ms, now)
                    .map_err(|have| RemoteError::StaleGeneration {
                        have,
                        got: generation,
                    })?;
                done(Ok(Response::Ok))
            }
            Request::VolumeIo { volume, op } => {
                let router = self
                    .router
                    .get()
                    .cloned()
                    .ok_or(RemoteError::NotOwner { volume })?;
                Box::pin(async move {
                    match router.serve_forwarded(volume, op, payload).await {
                        Ok(data) if data.is_empty() => (Response::Ok, data),
                        Ok(data) => (Response::Data, data),
                        Err(e) => (Response::Err(e), Bytes::new()),
                    }
                })
            }
        })
    }
}

impl Handler for Replicas {
    fn handle(&self, req: Request, payload: Bytes) -> Reply {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        let counted = InFlight(self.in_flight.clone());
        match self.execute(req, payload) {
            Ok(r) => Box::pin(async move {
                let out = r.await;
                drop(counted);
                out
            }),
            Err(e) => done(Err(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// Whether every one of `deps` is done.
    fn all_done(deps: &[watch::Receiver<bool>]) -> bool {
        deps.iter().all(|r| *r.borrow())
    }

    /// A write waits for the earlier overlapping reads and writes, a read
    /// for the earlier overlapping writes only, a look for nothing after
    /// it; requests of other ranges or components never wait.
    #[test]
    fn the_sequencer_keeps_writes_behind_earlier_reads_of_their_range() {
        let seq = Arc::new(Sequencer::default());
        let (deps, read) = seq.enter(1, 0, 8192, Access::Read);
        assert!(deps.is_empty() && read.is_some());
        // A second read of the range runs beside the first.
        let (deps, read2) = seq.enter(1, 4096, 8192, Access::Read);
        assert!(deps.is_empty());
        // A trim of the range waits for both reads.
        let (trim_deps, trim) = seq.enter(1, 4096, 12288, Access::Write);
        assert_eq!(trim_deps.len(), 2);
        // A read after the trim waits for the trim, not for the reads.
        assert_eq!(seq.enter(1, 8192, 12288, Access::Read).0.len(), 1);
        // Another range, or another component: no wait.
        assert!(seq.enter(1, 16384, 20480, Access::Write).0.is_empty());
        assert!(seq.enter(2, 0, 8192, Access::Write).0.is_empty());
        let (deps, _) = seq.enter(1, 0, 4096, Access::Look);
        assert!(deps.is_empty(), "a look waits for writes only");
        let (deps, _) = seq.enter(1, 4096, 8192, Access::Look);
        assert_eq!(deps.len(), 1);
        drop(read);
        assert!(!all_done(&trim_deps));
        drop(read2);
        assert!(
            all_done(&trim_deps),
            "the trim goes once both reads are done"
        );
        drop(trim);
        assert!(seq.enter(1, 0, u64::MAX, Access::Write).0.is_empty());
    }

    fn replicas(path: &std::path::Path) -> Replicas {
        let store = Arc::new(Store::open(path).unwrap());
        let d = Device::new(
            1,
            path.display().to_string(),
            store,
            &crate::NodeTuning::default(),
        )
        .unwrap();
        Replicas::new(vec![d])
    }

    /// Replicas over one device holding component 1 (8 MiB); the folder
    /// lives as long as the first value.
    fn one_component() -> (tempfile::TempDir, Replicas) {
        let (dir, _, r) = one_component_at();
        (dir, r)
    }

    /// [`one_component`], with the device file's path.
    fn one_component_at() -> (tempfile::TempDir, std::path::PathBuf, Replicas) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev.img");
        let s = Store::create(&path, 64 * MIB, "t").unwrap();
        s.create_component(1, 1, 8 * MIB).unwrap();
        s.close().unwrap();
        let r = replicas(&path);
        (dir, path, r)
    }

    async fn call(r: &Replicas, req: Request, payload: Bytes) -> Response {
        r.handle(req, payload).await.0
    }

    async fn write(r: &Replicas, generation: Generation, offset: u64, seq: u64) {
        let req = Request::Write {
            component: 1,
            generation,
            offset,
            seq,
        };
        let resp = call(r, req, Bytes::from(vec![7u8; 4096])).await;
        assert!(matches!(resp, Response::Ok), "{resp:?}");
    }

    async fn read_bytes(r: &Replicas, offset: u64, len: u32) -> Bytes {
        let req = Request::Read {
            component: 1,
            generation: 1,
            offset,
            len,
        };
        let (resp, data) = r.handle(req, Bytes::new()).await;
        assert!(matches!(resp, Response::Data), "{resp:?}");
        data
    }

    async fn barrier(r: &Replicas, generation: Generation, seq: u64) {
        tracking_barrier(r, generation, seq, false).await;
    }

    async fn tracking_barrier(r: &Replicas, generation: Generation, seq: u64, track: bool) {
        let req = Request::Barrier {
            component: 1,
            generation,
            seq,
            track,
        };
        assert!(matches!(call(r, req, Bytes::new()).await, Response::Ok));
    }

    async fn tracked(r: &Replicas) -> RegionSet {
        let req = Request::TrackedRegions { component: 1 };
        match call(r, req, Bytes::new()).await {
            Response::Tracked(set) => set,
            other => panic!("{other:?}"),
        }
    }

    fn runs(v: &[(u64, u64)]) -> RegionSet {
        RegionSet::Runs(v.to_vec())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tracking_barrier_keeps_what_it_settles_until_one_without_and_across_a_restart() {
        let (dir, path, r) = one_component_at();
        write(&r, 1, 0, 1).await;
        write(&r, 1, 2 * MIB, 2).await;
        // Writes no barrier covered are reported already.
        assert_eq!(tracked(&r).await, runs(&[(0, 1), (2, 1)]));
        tracking_barrier(&r, 1, 3, true).await;
        r.settle_marks();
        assert_eq!(marks(&r), vec![], "settled and unmarked");
        assert_eq!(tracked(&r).await, runs(&[(0, 1), (2, 1)]), "tracked");
        // A later write syncs the log; the node dies; its device reopens.
        write(&r, 1, 3 * MIB, 3).await;
        let copy = dir.path().join("copy.img");
        std::fs::copy(&path, &copy).unwrap();
        drop(r);
        let r = replicas(&copy);
        assert_eq!(tracked(&r).await, runs(&[(0, 1), (2, 2)]));
        // A barrier without track older than the last with it (queued on
        // a connection since replaced) changes nothing.
        tracking_barrier(&r, 2, 5, true).await;
        barrier(&r, 2, 4).await;
        r.settle_marks();
        assert_eq!(tracked(&r).await, runs(&[(0, 1), (2, 2)]));
        // Every copy in sync again: the set is emptied.
        barrier(&r, 2, 6).await;
        r.settle_marks();
        assert_eq!(tracked(&r).await, runs(&[]));
    }

    /// A resize grows a component and never shrinks it: an owner with
    /// an older size (a column activated by a stale owner) cannot undo a
    /// growth.
    #[tokio::test]
    async fn a_resize_grows_and_never_shrinks() {
        let (_dir, r) = one_component();
        let size = |r: &Replicas| r.device(1).unwrap().store.component(1).unwrap().size;
        let resize = |size| Request::ResizeComponent { component: 1, size };
        for (to, want) in [
            (4 * MIB, 8 * MIB),
            (16 * MIB, 16 * MIB),
            (8 * MIB, 16 * MIB),
        ] {
            let resp = call(&r, resize(to), Bytes::new()).await;
            assert!(matches!(resp, Response::Ok), "{resp:?}");
            assert_eq!(size(&r), want, "resized to {to}");
        }
        let other = Request::ResizeComponent {
            component: 2,
            size: MIB,
        };
        let resp = call(&r, other, Bytes::new()).await;
        assert!(
            matches!(resp, Response::Err(RemoteError::NoSuchComponent(2))),
            "{resp:?}"
        );
    }

    #[tokio::test]
    async fn a_copy_created_empty_reports_every_region_until_in_sync() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev.img");
        Store::create(&path, 64 * MIB, "t")
            .unwrap()
            .close()
            .unwrap();
        let r = replicas(&path);
        let create = Request::CreateComponent {
            component: 1,
            volume: 1,
            device: 1,
            size: 8 * MIB,
        };
        assert!(matches!(
            call(&r, create.clone(), Bytes::new()).await,
            Response::Ok
        ));
        assert_eq!(tracked(&r).await, RegionSet::All);
        barrier(&r, 1, 0).await;
        assert_eq!(tracked(&r).await, runs(&[]));
        // Created again once activated: it keeps its data, and its set.
        assert!(matches!(call(&r, create, Bytes::new()).await, Response::Ok));
        assert_eq!(tracked(&r).await, runs(&[]));
    }

    #[tokio::test]
    async fn hostile_tracking_requests_are_refused_and_change_nothing() {
        let (_dir, r) = one_component();
        // Runs out of order or overlapping: refused whole.
        let unordered = Request::Track {
            component: 1,
            generation: 1,
            regions: runs(&[(4, 1), (1, 1)]),
        };
        let resp = call(&r, unordered, Bytes::new()).await;
        assert!(
            matches!(resp, Response::Err(RemoteError::BadRequest(_))),
            "{resp:?}"
        );
        let overlapping = Request::Track {
            component: 1,
            generation: 1,
            regions: runs(&[(0, 3), (2, 1)]),
        };
        let resp = call(&r, overlapping, Bytes::new()).await;
        assert!(
            matches!(resp, Response::Err(RemoteError::BadRequest(_))),
            "{resp:?}"
        );
        assert_eq!(tracked(&r).await, runs(&[]));
        // A component this node does not hold.
        for req in [
            Request::TrackedRegions { component: 9 },
            Request::Track {
                component: 9,
                generation: 1,
                regions: RegionSet::All,
            },
        ] {
            let resp = call(&r, req, Bytes::new()).await;
            assert!(
                matches!(resp, Response::Err(RemoteError::NoSuchComponent(9))),
                "{resp:?}"
            );
        }
    }

    #[tokio::test]
    async fn a_seed_is_tracked_and_fenced() {
        let (_dir, r) = one_component();
        let track = |generation| Request::Track {
            component: 1,
            generation,
            regions: runs(&[(1, 2), (6, 100)]),
        };
        assert!(matches!(
            call(&r, track(2), Bytes::new()).await,
            Response::Ok
        ));
        // Cut at the component's end (8 regions).
        assert_eq!(tracked(&r).await, runs(&[(1, 2), (6, 2)]));
        assert!(matches!(
            call(&r, track(1), Bytes::new()).await,
            Response::Err(RemoteError::StaleGeneration { have: 2, got: 1 })
        ));
    }

    /// Many trims in one request: each range reads back as zeros, the
    /// blocks between keep their data, and the regions are marked like a
    /// zeroing's. Ranges out of order, overlapping, empty or too many, a
    /// range past the end and an old generation are refused, and change
    /// nothing.
    #[tokio::test]
    async fn trims_of_many_ranges_zero_each_and_bad_ones_change_nothing() {
        let (_dir, r) = one_component();
        for b in 0..8u64 {
            write(&r, 1, b * 4096, b + 1).await;
        }
        let trim = |ranges: Vec<(u64, u64)>, generation| Request::TrimRanges {
            component: 1,
            generation,
            ranges,
            seq: 20,
        };
        let before = read_bytes(&r, 0, 8 * 4096).await;
        let many = vec![(0u64, 1u64); shoal_rpc::MAX_TRIM_RANGES + 1]
            .iter()
            .enumerate()
            .map(|(i, _)| (i as u64 * 8192, 4096))
            .collect();
        for bad in [
            trim(vec![], 1),
            trim(vec![(4096, 4096), (0, 4096)], 1),
            trim(vec![(0, 8192), (4096, 4096)], 1),
            trim(vec![(0, 4096), (8192, 0)], 1),
            trim(vec![(u64::MAX - 10, 4096)], 1),
            trim(many, 1),
        ] {
            let resp = call(&r, bad, Bytes::new()).await;
            assert!(
                matches!(resp, Response::Err(RemoteError::BadRequest(_))),
                "{resp:?}"
            );
        }
        let past_end = call(&r, trim(vec![(0, 4096), (64 * MIB, 4096)], 1), Bytes::new()).await;
        assert!(matches!(past_end, Response::Err(_)), "{past_end:?}");
        let stale = call(&r, trim(vec![(0, 4096)], 0), Bytes::new()).await;
        assert!(
            matches!(stale, Response::Err(RemoteError::StaleGeneration { .. })),
            "{stale:?}"
        );
        assert!(
            read_bytes(&r, 0, 8 * 4096).await == before,
            "a refused trim changed data"
        );
        let ok = call(
            &r,
            trim(vec![(0, 4096), (8192, 8192), (28672, 4096)], 1),
            Bytes::new(),
        )
        .await;
        assert!(matches!(ok, Response::Ok), "{ok:?}");
        let after = read_bytes(&r, 0, 8 * 4096).await;
        for b in 0..8usize {
            let block = &after[b * 4096..(b + 1) * 4096];
            let zeroed = [0, 2, 3, 7].contains(&b);
            assert_eq!(block.iter().all(|&x| x == 0), zeroed, "block {b}");
            if !zeroed {
                assert!(
                    block == &before[b * 4096..(b + 1) * 4096],
                    "block {b} changed"
                );
            }
        }
    }

    fn marks(r: &Replicas) -> Vec<(u64, Vec<u32>)> {
        r.devices()[0].store.marked_regions()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn writes_stay_marked_on_the_device_until_settled_and_across_a_restart() {
        let (dir, path, r) = one_component_at();
        write(&r, 1, 0, 1).await;
        write(&r, 1, 2 * MIB + 4096, 2).await;
        assert_eq!(marks(&r), vec![(1, vec![0, 2])]);
        // Not settled before a barrier covers the writes.
        r.settle_marks();
        assert_eq!(marks(&r), vec![(1, vec![0, 2])]);
        barrier(&r, 1, 3).await;
        r.settle_marks();
        assert_eq!(marks(&r), vec![]);
        // Zeroes are marked and settled the same way.
        let zero = Request::WriteZeroes {
            component: 1,
            generation: 1,
            offset: 3 * MIB,
            len: 8192,
            seq: 3,
        };
        assert!(matches!(call(&r, zero, Bytes::new()).await, Response::Ok));
        assert_eq!(marks(&r), vec![(1, vec![3])]);
        barrier(&r, 1, 4).await;
        r.settle_marks();
        assert_eq!(marks(&r), vec![]);
        // Written again: marked again (the mirror forgot the old mark).
        write(&r, 1, 4096, 4).await;
        assert_eq!(marks(&r), vec![(1, vec![0])]);

        // The node dies: a copy of the device as it is (the write above
        // was acknowledged, so its mark is durable) is opened again.
        let copy = dir.path().join("copy.img");
        std::fs::copy(&path, &copy).unwrap();
        drop(r);
        let r = replicas(&copy);
        let req = Request::Activate {
            component: 1,
            generation: 2,
        };
        match call(&r, req, Bytes::new()).await {
            Response::Activated { dirty, .. } => assert_eq!(dirty, vec![(0, REGION)]),
            other => panic!("{other:?}"),
        }
        // The old owner's barrier is fenced off; the new owner's, sent once
        // it reconciled the region, settles it.
        let old = Request::Barrier {
            component: 1,
            generation: 1,
            seq: 9,
            track: false,
        };
        let resp = call(&r, old, Bytes::new()).await;
        assert!(
            matches!(resp, Response::Err(RemoteError::StaleGeneration { .. })),
            "{resp:?}"
        );
        r.settle_marks();
        assert_eq!(marks(&r), vec![(1, vec![0])]);
        barrier(&r, 2, 0).await;
        r.settle_marks();
        assert_eq!(marks(&r), vec![]);
    }

    /// Owners' copies (`seq == 0`: resync, rebuild, reconciliation) are
    /// counted apart from client writes; zeroings by their length.
    #[tokio::test]
    async fn copies_are_counted_apart_from_client_writes() {
        let (_dir, r) = one_component();
        write(&r, 1, 0, 1).await;
        write(&r, 1, MIB, 0).await;
        let zero = |seq| Request::WriteZeroes {
            component: 1,
            generation: 1,
            offset: 2 * MIB,
            len: 8192,
            seq,
        };
        assert!(matches!(
            call(&r, zero(0), Bytes::new()).await,
            Response::Ok
        ));
        assert!(matches!(
            call(&r, zero(2), Bytes::new()).await,
            Response::Ok
        ));
        let d = r.devices()[0].clone();
        assert_eq!(d.resync_written.load(Ordering::Relaxed), 4096 + 8192);
        assert_eq!(d.written.load(Ordering::Relaxed), 2 * 4096);
    }

    /// A read never changes a replica's state: one with a newer generation
    /// than the copy's is refused and leaves the generation as it was; one
    /// with the copy's generation is served; an older one is stale.
    #[tokio::test]
    async fn a_read_never_changes_the_generation() {
        let (_dir, r) = one_component();
        write(&r, 1, 0, 1).await;
        let read = |generation| Request::Read {
            component: 1,
            generation,
            offset: 0,
            len: 4096,
        };
        let resp = call(&r, read(1_000_000), Bytes::new()).await;
        assert!(
            matches!(resp, Response::Err(RemoteError::Unavailable(_))),
            "{resp:?}"
        );
        let d = r.devices()[0].clone();
        assert_eq!(d.store.generation(1), Some(1), "the read changed nothing");
        assert!(matches!(
            call(&r, read(1), Bytes::new()).await,
            Response::Data
        ));
        let act = Request::Activate {
            component: 1,
            generation: 3,
        };
        assert!(matches!(
            call(&r, act, Bytes::new()).await,
            Response::Activated { .. }
        ));
        let resp = call(&r, read(1), Bytes::new()).await;
        assert!(
            matches!(resp, Response::Err(RemoteError::StaleGeneration { .. })),
            "{resp:?}"
        );
    }

    /// The lease protocol's replica half: a renewal is granted only to the
    /// copy's own generation and changes no generation; the activation of
    /// a newer owner reports what is left of the lease, after which the
    /// older owner's renewals are stale.
    #[tokio::test]
    async fn renewals_are_granted_to_the_current_owner_only() {
        let (_dir, r) = one_component();
        let activate = |generation| Request::Activate {
            component: 1,
            generation,
        };
        let renew = |generation, lease_ms| Request::Renew {
            component: 1,
            generation,
            lease_ms,
        };
        call(&r, activate(2), Bytes::new()).await;
        let resp = call(&r, renew(2, 2_000), Bytes::new()).await;
        assert_eq!(resp, Response::Ok);
        let resp = call(&r, renew(5, 2_000), Bytes::new()).await;
        assert!(
            matches!(resp, Response::Err(RemoteError::Unavailable(_))),
            "{resp:?}"
        );
        let d = r.devices()[0].clone();
        assert_eq!(d.store.generation(1), Some(2), "a renewal changed nothing");
        let resp = call(&r, renew(2, shoal_rpc::MAX_LEASE_MS + 1), Bytes::new()).await;
        assert!(
            matches!(resp, Response::Err(RemoteError::BadRequest(_))),
            "{resp:?}"
        );
        // Generation 3 takes over: the lease just granted may still run
        // about two seconds (and the drift margin), never more.
        match call(&r, activate(3), Bytes::new()).await {
            Response::Activated { lease_ms, .. } => {
                let most = shoal_owner::lease::with_drift_margin(2_000);
                assert!(lease_ms > 1_500 && lease_ms <= most, "{lease_ms}");
            }
            other => panic!("{other:?}"),
        }
        let resp = call(&r, renew(2, 2_000), Bytes::new()).await;
        assert!(
            matches!(resp, Response::Err(RemoteError::StaleGeneration { .. })),
            "{resp:?}"
        );
    }
}
