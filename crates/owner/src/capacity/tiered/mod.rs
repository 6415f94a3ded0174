//! The owner of an erasure-coded volume: one task driven by one loop of
//! typed events, in front of a RAID-1 [`Owner`] of the performance leg
//! and the [`ColumnSet`] of the capacity leg. It stages client writes on
//! the performance leg, routes reads by the [`Tier`], destages full
//! stripes one at a time, writes the map log one write at a time (a
//! record, or parts of a checkpoint) through the performance leg, and sends the trims and acknowledgements a
//! durable record allows, in the order `crates/owner/src/stripes/tier.rs`
//! requires.
//!
//! A write or zeroing not of whole 4 KiB blocks is a read-modify-write of
//! its first and last blocks, which holds later writes to those blocks
//! back until its whole blocks are written.

mod grow;
mod heal;
mod lower;

use super::{BlockReads, ColumnError, ColumnSet, ColumnTarget};
use crate::status::TierStatus;
use crate::stripes::{
    classify, summary_of, Applied, Columns, LogPlace, MapBounds, MapRecord, Source, Ticket, Tier,
    BLOCKS_PER_UNIT, BLOCK_BYTES,
};
use crate::{Control, Op, Owner, OwnerConfig, OwnerError, View};
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use shoal_model::{ComponentRole, ComponentState, Generation};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

type Reply = oneshot::Sender<Result<Bytes, OwnerError>>;

/// Bytes of the map log read at a time when an owner starts.
const LOG_READ_BYTES: u64 = 1 << 20;
/// Blocks a new owner reads back from its performance leg per request,
/// looking for mapped blocks that read as zeros: 1 MiB.
const RECOVER_READ_BLOCKS: u64 = 256;
/// Of those requests, in flight at once: 8 MiB buffered at most.
const RECOVER_READS_IN_FLIGHT: usize = 8;
/// How long a new owner waits for the leg's reconcile, in I/O timeouts:
/// it copies a few regions a dead owner left in flight, far less.
const RECONCILE_WAIT_TIMEOUTS: u32 = 20;
/// Interval of the checks of the leg's reconcile, in milliseconds.
const RECONCILE_POLL_MS: u64 = 20;
/// Interval after which a partly filled stripe is destaged if no write
/// was staged in it, in milliseconds: the performance leg empties while
/// clients pause, and a lone write is not held there for long; while
/// writes keep coming, stripes go out full (a partly filled one takes a
/// whole slot until the cleaner moves its blocks).
const IDLE_DESTAGE_MS: u64 = 200;

/// Staged writes an owner keeps in memory, in bytes, so that destage
/// need not read them back from the performance leg: a few seconds of
/// writes at the rates this owner sustains. Past it, destage reads the
/// leg.
const WRITE_CACHE_BYTES: usize = 64 << 20;
/// Pending blocks a tick walks for the volume's written blocks: a few
/// milliseconds of the loop at most (a map lookup each), where a column
/// out of service can keep millions of blocks pending. A pass over 10
/// million takes some two minutes of ticks; the count shown is the last
/// pass's.
const WRITTEN_SCAN_BLOCKS: usize = 16_384;

/// Interval between tries to bring a column out of service back, in
/// milliseconds: a restarted node answers within a few, and a dead one
/// costs one refused connection per try.
const COLUMN_RETRY_MS: u64 = 2000;

/// Handle to a running erasure-coded owner. Cheap to clone.
#[derive(Clone)]
pub struct TieredOwner {
    tx: mpsc::UnboundedSender<Ev>,
    leg: Owner,
    status: Arc<Mutex<TierStatus>>,
    reads: StripeReads,
    /// Set as the tiered loop's last act.
    ended: crate::Ended,
}

/// What a handle needs to read destaged blocks without the loop: the
/// tier's state (read under its lock), the columns, and the slot reads
/// in flight, all shared with the loop.
#[derive(Clone)]
struct StripeReads {
    tier: Arc<RwLock<Tier>>,
    set: Arc<ColumnSet>,
    reading: Arc<SlotReads>,
}

enum Ev {
    Io(Op, Reply),
    /// A staging write (first, count, seq) is done on the leg.
    Staged((u64, u64, u64)),
    /// The stripe being written into slot `.0` was written (or not).
    StripeWritten(u64, Result<(), ColumnError>),
    /// Reading the blocks of the stripe for slot `.0` failed.
    StripeUnread(u64, OwnerError),
    /// The record in flight was written (or not).
    RecordWritten(Result<(), OwnerError>),
    /// The trims a record allowed are done: acknowledge these zeroings.
    Trimmed(Vec<Ticket>),
    /// A read-modify-write's whole blocks (blocks `span`), or why not.
    Merged {
        span: (u64, u64),
        result: Result<Bytes, OwnerError>,
        reply: Reply,
    },
    /// A read-modify-write's blocks (first, end) are written: unlock.
    Unlock((u64, u64)),
    /// Columns that failed a read: out of service.
    ColumnsFailed(Vec<usize>),
    /// Column `.0`, out of service, answered its activation (or not).
    Revived(usize, Result<(), ColumnError>),
    /// The directory's view of the volume changed.
    View(Box<View>),
    /// The directory answered a request to rebuild a lost column.
    RebuildAsked(Result<(), crate::ControlError>),
    /// The column rebuilt in place of a lost one is filled (its
    /// connection), or why not.
    ColumnCopied(Box<Result<shoal_rpc::Peer, ColumnError>>),
    /// The directory answered the commit or abort of a column change.
    ColumnChangeEnded {
        commit: bool,
        result: Result<(), crate::ControlError>,
    },
    /// Lowering to RAID-1: blocks read back from the stripes, and the
    /// columns that failed meanwhile.
    ReadBack(Vec<lower::ReadBack>, Vec<usize>),
    /// A staging of blocks read back ended.
    ReadBackStaged(Result<(), OwnerError>),
    /// The look for blocks to read back stopped at its walk's bound: the
    /// pump after this event looks on.
    ReadBackLook,
    /// The map log was trimmed (or not).
    LogTrimmed(Result<(), OwnerError>),
    /// The directory answered the lowering's commit.
    Lowered(Result<(), crate::ControlError>),
    /// A growth's columns and copies are grown; the columns that were
    /// not (out of service).
    GrowResized(Vec<usize>),
    /// A growth's old map log was trimmed (or not).
    GrowTrimmed(Result<(), OwnerError>),
    /// The directory answered the commit of the growth to `.0` bytes.
    GrowCommitted(u64, Result<(), crate::ControlError>),
    Tick,
    Stop,
}

impl TieredOwner {
    /// Starts the performance leg's owner (its view without the stripe
    /// columns), takes the columns over under `generation`, recovers the
    /// map from the log and the pending blocks from the leg, and serves.
    pub async fn start<C: Control>(
        cfg: OwnerConfig,
        view: View,
        generation: Generation,
        control: std::sync::Arc<C>,
    ) -> Result<TieredOwner, OwnerError> {
        let v = view.volume.clone();
        let geometry = v
            .stripe
            .ok_or_else(|| OwnerError::Unavailable("not an erasure-coded volume".into()))?;
        let columns = column_targets(&view);
        let copies = in_sync_copies(&view);
        let (timeout, auth) = (cfg.io_timeout, cfg.peer_auth.clone());
        let directory: Arc<dyn heal::ColumnControl> = Arc::new(heal::Directory {
            control: control.clone(),
            volume: v.id,
        });
        let first_view = view.clone();
        let leg = Owner::start_mirror(cfg, view, generation, control).await?;
        let taken = async {
            let g = shoal_erasure::Geometry::of(geometry)
                .map_err(|e| OwnerError::Unavailable(e.to_string()))?;
            let bounds = MapBounds::of(&Columns::new(g), v.size);
            let found = read_map(&leg, &v, bounds, timeout).await?;
            let map = found.map;
            // A column is created only while no stripe is mapped (a new
            // capacity leg): one its node lost once stripes were written
            // stays out, to be rebuilt, rather than come back empty and
            // read as zeros.
            let set = ColumnSet::activate(
                geometry,
                (v.id, v.size),
                columns,
                (generation, map.is_empty()),
                timeout,
                &auth,
            )
            .await
            .map_err(column_failure)?;
            let log = (found.log, found.torn_move_upto);
            recover(
                &leg,
                set,
                map,
                (v.id, v.size),
                log.0,
                &copies,
                (timeout, &auth),
            )
            .await
            .map(|(set, tier)| (set, tier, log.1))
        }
        .await;
        match taken {
            Ok((set, tier, torn_move_upto)) => {
                let heal = heal::Healing::new(directory, &first_view);
                Ok(TieredOwner::serve(
                    leg,
                    (v.size, set, tier, torn_move_upto),
                    (heal, (timeout, auth)),
                    first_view,
                ))
            }
            Err(e) => {
                leg.stop();
                Err(e)
            }
        }
    }

    /// Starts the loop and its ticker.
    fn serve(
        leg: Owner,
        (size, set, tier, torn_move_upto): (u64, ColumnSet, Tier, u64),
        (heal, peer_io): (heal::Healing, (Duration, shoal_rpc::PeerAuth)),
        view: View,
    ) -> TieredOwner {
        let (tx, rx) = mpsc::unbounded_channel();
        let status = Arc::new(Mutex::new(TierStatus::default()));
        // Counted whole once, at the takeover (which walks the leg's
        // blocks anyway); the ticks then count it a part at a time.
        let written_blocks = tier.written_blocks();
        let (set, tier) = (Arc::new(set), Arc::new(RwLock::new(tier)));
        let reading = Arc::new(SlotReads::default());
        let ended = crate::Ended::default();
        let lp = Loop {
            ended: ended.clone(),
            size,
            leg: leg.clone(),
            set: set.clone(),
            tier: tier.clone(),
            tx: tx.clone(),
            reading: reading.clone(),
            recording: false,
            tickets: BTreeMap::new(),
            direct_data: std::collections::HashMap::new(),
            trims_done: None,
            ready: BTreeSet::new(),
            acked_upto: 0,
            idle: false,
            busy: false,
            reviving: BTreeSet::new(),
            revived_at: None,
            status: status.clone(),
            stripes_written: 0,
            direct_stripes: 0,
            written_blocks,
            written_scan: Default::default(),
            heal,
            cache: WriteCache::default(),
            copied_peer: None,
            locks: Vec::new(),
            blocked: Default::default(),
            lowering: None,
            growth: None,
            torn_move_upto,
            peer_io,
        };
        // A column change in progress (an earlier owner's) is carried
        // out again from the start.
        let _ = tx.send(Ev::View(Box::new(view)));
        tokio::spawn(lp.run(rx));
        let ticker = tx.clone();
        tokio::spawn(async move {
            let mut t = tokio::time::interval(Duration::from_millis(IDLE_DESTAGE_MS));
            loop {
                t.tick().await;
                if ticker.send(Ev::Tick).is_err() {
                    return;
                }
            }
        });
        TieredOwner {
            tx,
            leg,
            status,
            reads: StripeReads { tier, set, reading },
            ended,
        }
    }

    /// The directory changed: a column change to carry out, the repair
    /// delay.
    pub fn update(&self, view: View) {
        let _ = self.tx.send(Ev::View(Box::new(view)));
    }

    /// The capacity leg as the loop last published it.
    pub fn status(&self) -> TierStatus {
        match self.status.lock() {
            Ok(s) => s.clone(),
            Err(e) => e.into_inner().clone(),
        }
    }

    /// Runs one operation; reads answer data, everything else empty bytes.
    pub async fn execute(&self, op: Op) -> Result<Bytes, OwnerError> {
        if let Op::Read { offset, len } = op {
            if let Some(read) = self.read_stripes(offset, len) {
                return read.await;
            }
        }
        let rx = self.send(op).ok_or(OwnerError::Stopped)?;
        rx.await.map_err(|_| OwnerError::Stopped)?
    }

    /// A read of whole blocks that are all destaged (or never written),
    /// routed here by the tier's state as the loop would route it, and
    /// sent to the columns without a round through the loop; None (to go
    /// through the loop) for a read of blocks on the performance leg, of
    /// parts of blocks, past the end, or once the loop stopped. Its slots
    /// are counted in under the tier's lock, so no stripe is written over
    /// them until the read is done.
    pub(crate) fn read_stripes(
        &self,
        offset: u64,
        len: u32,
    ) -> Option<impl std::future::Future<Output = Result<Bytes, OwnerError>> + Send + 'static> {
        let block = BLOCK_BYTES as u64;
        let aligned = offset.is_multiple_of(block) && u64::from(len).is_multiple_of(block);
        if !aligned || len == 0 || self.tx.is_closed() {
            return None;
        }
        let parts = {
            let tier = self.reads.tier.read().unwrap_or_else(|e| e.into_inner());
            if offset.checked_add(u64::from(len))? > tier.volume_bytes() {
                return None;
            }
            let span = (offset / block, u64::from(len) / block);
            route(&tier, &self.reads.reading, span, false)?
        };
        let sent = send_parts(parts, None);
        let (reads, tx) = (self.reads.clone(), self.tx.clone());
        Some(async move {
            let ends = (&*reads.set, &tx, &*reads.reading);
            gather(sent, len, ends).await
        })
    }

    /// Hands one operation to the loop now (its place in the volume's
    /// order); None once the loop stopped.
    pub(crate) fn send(&self, op: Op) -> Option<oneshot::Receiver<Result<Bytes, OwnerError>>> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Ev::Io(op, tx)).ok()?;
        Some(rx)
    }

    /// The performance leg's RAID-1 owner.
    pub(crate) fn leg(&self) -> &Owner {
        &self.leg
    }

    pub fn is_running(&self) -> bool {
        !self.tx.is_closed() && self.leg.is_running()
    }

    /// Set once the tiered loop has ended: it reads no stripe any more
    /// ([`TieredOwner::read_stripes`] refuses once its channel closed).
    pub(crate) fn ended(&self) -> crate::Ended {
        self.ended.clone()
    }

    pub fn stop(&self) {
        let _ = self.tx.send(Ev::Stop);
        self.leg.stop();
    }
}

/// The stripe columns of a view, by position: with a column change in
/// progress, the columns it replaces (the loop carries it out again).
fn column_targets(view: &View) -> Vec<ColumnTarget> {
    let added = |id: u64| {
        view.volume
            .reconfig
            .as_ref()
            .is_some_and(|r| r.added.contains(&id))
    };
    let mut columns: Vec<(u8, ColumnTarget)> = view
        .targets
        .iter()
        .filter(|t| !added(t.component.id))
        .filter_map(|t| match t.component.role {
            ComponentRole::Stripe { position } => {
                let c = ColumnTarget {
                    component: t.component.id,
                    device: t.component.device,
                    addr: t.addr.clone(),
                };
                Some((position, c))
            }
            _ => None,
        })
        .collect();
    columns.sort_by_key(|c| c.0);
    columns.into_iter().map(|c| c.1).collect()
}

/// The performance leg's in-sync copies: (address, component).
fn in_sync_copies(view: &View) -> Vec<(String, u64)> {
    view.targets
        .iter()
        .filter(|t| t.component.role == ComponentRole::Data)
        .filter(|t| t.component.state == ComponentState::Active)
        .map(|t| (t.addr.clone(), t.component.id))
        .collect()
}

/// What the map log gives a new owner.
struct Found {
    map: crate::stripes::StripeMap,
    /// Where the log it was read from lies: its place, or during a growth
    /// the new one once that holds a complete checkpoint.
    log: LogPlace,
    /// The highest seq of records at a growth's new place that holds no
    /// complete checkpoint (a move torn by a crash): the move made again
    /// numbers its records above them.
    torn_move_upto: u64,
}

/// The map a new owner starts from, read from the log once the leg's
/// copies agree (`docs/erasure-coding.md`, A new owner, and Growing).
async fn read_map(
    leg: &Owner,
    v: &shoal_model::Volume,
    bounds: MapBounds,
    timeout: Duration,
) -> Result<Found, OwnerError> {
    reconciled(leg, timeout * RECONCILE_WAIT_TIMEOUTS).await?;
    let unavailable = |e: crate::stripes::TierError| OwnerError::Unavailable(e.to_string());
    let here = LogPlace::of(v);
    let records = read_log(leg, v.id, here).await?;
    let Some(to) = v.grow_to else {
        return Ok(Found {
            map: Tier::recover_map(&records, bounds).map_err(unavailable)?,
            log: here,
            torn_move_upto: 0,
        });
    };
    let moved = LogPlace::grown(v, to);
    let moved_records = read_log(leg, v.id, moved).await?;
    let g = Tier::recover_growing(&records, &moved_records, bounds).map_err(unavailable)?;
    Ok(Found {
        map: g.map,
        log: if g.moved { moved } else { here },
        torn_move_upto: g.torn_move_upto,
    })
}

/// What a new owner serves from: the map from the log, and the pending
/// blocks from the leg (`docs/erasure-coding.md`, A new owner).
async fn recover(
    leg: &Owner,
    set: ColumnSet,
    map: crate::stripes::StripeMap,
    (volume, size): (u64, u64),
    log: LogPlace,
    copies: &[(String, u64)],
    (timeout, auth): (Duration, &shoal_rpc::PeerAuth),
) -> Result<(ColumnSet, Tier), OwnerError> {
    let allocated = allocated_blocks(copies, size, timeout, auth).await?;
    let mapped_zeros = mapped_zeros(leg, &map, &allocated).await?;
    let pending = classify(&map, allocated, |b| mapped_zeros.contains(&b));
    // The slots replay checked the map against (`MapBounds`).
    let slots = MapBounds::of(set.columns(), size).slots;
    let tier = Tier::new(volume, size, *set.columns(), map, pending, (log, slots));
    Ok((set, tier))
}

/// Of the blocks `allocated` on the performance leg, those the map holds
/// and the leg reads as zeros (step 5 of "A new owner"), read back in
/// runs of neighbours, a few runs at a time: after a column was out of
/// service, millions of blocks can be both, and one read each, one
/// after the other, would hold the volume's takeover for minutes.
async fn mapped_zeros(
    leg: &Owner,
    map: &crate::stripes::StripeMap,
    allocated: &[u64],
) -> Result<BTreeSet<u64>, OwnerError> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for &b in allocated.iter().filter(|&&b| map.get(b).is_some()) {
        match runs.last_mut() {
            Some((f, n)) if *f + *n == b && *n < RECOVER_READ_BLOCKS => *n += 1,
            _ => runs.push((b, 1)),
        }
    }
    let block = BLOCK_BYTES as u64;
    let reads = futures::stream::iter(runs).map(|(first, n)| async move {
        let d = leg.read(first * block, (n * block) as u32).await?;
        match d.len() as u64 == n * block {
            true => Ok((first, d)),
            false => Err(OwnerError::Unavailable(format!(
                "the performance leg answered {} bytes for {n} blocks at block {first}",
                d.len()
            ))),
        }
    });
    let mut reads = std::pin::pin!(reads.buffered(RECOVER_READS_IN_FLIGHT));
    let mut zeros = BTreeSet::new();
    while let Some(r) = reads.next().await {
        let (first, d) = r?;
        for (i, c) in d.chunks(BLOCK_BYTES).enumerate() {
            if c.iter().all(|&x| x == 0) {
                zeros.insert(first + i as u64);
            }
        }
    }
    Ok(zeros)
}

/// Waits until the leg's copies agree again (what a dead owner left in
/// flight is reconciled), at most `bound`.
async fn reconciled(leg: &Owner, bound: Duration) -> Result<(), OwnerError> {
    let start = std::time::Instant::now();
    while leg.healing().reconciling {
        if start.elapsed() > bound {
            return Err(OwnerError::Unavailable(
                "the performance leg's copies are still being reconciled".into(),
            ));
        }
        tokio::time::sleep(Duration::from_millis(RECONCILE_POLL_MS)).await;
    }
    Ok(())
}

/// Every valid record of volume `volume`'s map log at `log` (past its
/// end on the performance leg): blocks that are not records (never
/// written, torn) are skipped.
async fn read_log(leg: &Owner, volume: u64, log: LogPlace) -> Result<Vec<MapRecord>, OwnerError> {
    let (size, bytes) = (log.at, log.records * BLOCK_BYTES as u64);
    let mut found = Vec::new();
    let mut at = 0;
    while at < bytes {
        let len = LOG_READ_BYTES.min(bytes - at);
        let d = leg.read(size + at, len as u32).await?;
        for block in d.chunks(BLOCK_BYTES) {
            if let Ok(r) = MapRecord::decode(block) {
                if r.volume() == volume {
                    found.push(r);
                }
            }
        }
        at += len;
    }
    Ok(found)
}

/// The blocks below `size` allocated on one in-sync copy of the
/// performance leg (after its reconcile, the copies agree).
async fn allocated_blocks(
    copies: &[(String, u64)],
    size: u64,
    timeout: Duration,
    auth: &shoal_rpc::PeerAuth,
) -> Result<Vec<u64>, OwnerError> {
    let mut last = String::from("no in-sync copy");
    for (addr, component) in copies {
        let component = *component;
        let answer = async {
            let p = shoal_rpc::Peer::connect(addr, timeout, auth).await?;
            let req = shoal_rpc::Request::AllocatedRanges { component };
            p.call(&req, Bytes::new(), timeout).await
        };
        match answer.await {
            Ok((shoal_rpc::Response::Ranges(ranges), _)) => {
                let block = BLOCK_BYTES as u64;
                let blocks = ranges.into_iter().flat_map(|(off, len)| {
                    let end = off.saturating_add(len).min(size);
                    (off / block..end.div_ceil(block)).filter(move |b| b * block < end)
                });
                return Ok(blocks.collect());
            }
            Ok((other, _)) => last = format!("{other:?}"),
            Err(e) => last = e.to_string(),
        }
    }
    Err(OwnerError::Unavailable(format!(
        "no copy of the performance leg told its blocks: {last}"
    )))
}

fn column_failure(e: ColumnError) -> OwnerError {
    match e {
        ColumnError::Deposed { .. } => OwnerError::Deposed,
        e => OwnerError::Unavailable(e.to_string()),
    }
}

struct Loop {
    /// Set as the loop's last act ([`TieredOwner::ended`]).
    ended: crate::Ended,
    size: u64,
    leg: Owner,
    set: Arc<ColumnSet>,
    /// The tier's state: the loop's alone to change; the handles read
    /// it to route reads of destaged blocks without the loop
    /// ([`TieredOwner::read_stripes`]). Locked for the length of one call.
    tier: Arc<RwLock<Tier>>,
    tx: mpsc::UnboundedSender<Ev>,
    /// Stripe slots with reads in flight: not written until they end.
    reading: Arc<SlotReads>,
    recording: bool,
    /// Zeroings and writes straight to the capacity leg waiting for
    /// their ticket.
    tickets: BTreeMap<Ticket, Reply>,
    /// The data of each write straight to the capacity leg in flight, by
    /// ticket, with its first block: staged instead if its stripe fails
    /// (at most [`crate::stripes::MAX_DIRECT_STRIPES`] stripes of it).
    direct_data: std::collections::HashMap<Ticket, (u64, Bytes)>,
    /// Done once the trims of the last record applied (and of every
    /// record before it) are: its tickets wait for that.
    trims_done: Option<oneshot::Receiver<()>>,
    /// Tickets whose unmap and trims are done, waiting for earlier ones.
    ready: BTreeSet<Ticket>,
    acked_upto: Ticket,
    /// A tick came with no write staged since the one before: a partly
    /// filled stripe may go.
    idle: bool,
    /// A write was staged since the last tick.
    busy: bool,
    /// Columns out of service being activated again.
    reviving: BTreeSet<usize>,
    /// When columns out of service were last tried.
    revived_at: Option<Instant>,
    status: Arc<Mutex<TierStatus>>,
    stripes_written: u64,
    /// Of those, stripes of client writes straight to the capacity leg.
    direct_stripes: u64,
    /// `Tier::written_blocks` as of the last tick.
    written_blocks: u64,
    /// Where the ticks' count of written blocks stands.
    written_scan: crate::stripes::WrittenScan,
    /// Staged blocks' data by block, with the write that put it there
    /// (at most [`WRITE_CACHE_BYTES`]): what a destage of that write
    /// takes instead of reading the leg.
    cache: WriteCache,
    /// The rebuild of lost columns.
    heal: heal::Healing,
    /// The filled column of a rebuild, put in service once committed.
    copied_peer: Option<shoal_rpc::Peer>,
    /// Blocks (first, end) of read-modify-writes in progress.
    locks: Vec<(u64, u64)>,
    /// Writes and zeroings waiting for those locks, in order.
    blocked: std::collections::VecDeque<(Op, Reply)>,
    /// The lowering to RAID-1 in progress.
    lowering: Option<lower::Lowering>,
    /// The growth in progress.
    growth: Option<grow::Growth>,
    /// [`Found::torn_move_upto`]: what a move of the log numbers above.
    torn_move_upto: u64,
    /// How long a node may take to answer, and how the owner proves
    /// itself to it: for requests outside the loops' connections.
    peer_io: (Duration, shoal_rpc::PeerAuth),
}

impl Ev {
    /// An event of the I/O path: one or more per client I/O.
    fn is_io_path(&self) -> bool {
        matches!(
            self,
            Ev::Io(..)
                | Ev::Staged(_)
                | Ev::StripeWritten(..)
                | Ev::RecordWritten(_)
                | Ev::Trimmed(_)
                | Ev::Merged { .. }
                | Ev::Unlock(_)
                | Ev::ReadBackLook
        )
    }
}

/// The blocks (first, end) an operation changes, if it changes any.
fn changes(op: &Op) -> Option<(u64, u64)> {
    let block = BLOCK_BYTES as u64;
    let span = |off: u64, len: u64| (off / block, (off + len).div_ceil(block));
    match op {
        Op::Write { offset, data } => Some(span(*offset, data.len() as u64)),
        Op::Zero { offset, len } => Some(span(*offset, *len)),
        _ => None,
    }
}

impl Loop {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Ev>) {
        while let Some(ev) = rx.recv().await {
            // The status is published after every event but those of the
            // I/O path (a client's writes and reads, staging, stripes,
            // records, trims), which the next tick publishes: building it
            // names every column, too much to do per 4 KiB write.
            let quiet = ev.is_io_path();
            let go_on = match ev {
                Ev::Io(op, reply) => {
                    self.io(op, reply);
                    true
                }
                Ev::Staged((first, count, seq)) => {
                    self.tier().staged(first, count, seq);
                    self.busy = true;
                    self.replay_blocked();
                    true
                }
                Ev::StripeWritten(slot, r) => self.stripe_written(slot, r),
                Ev::StripeUnread(slot, e) => {
                    tracing::warn!(error = %e, "destage read failed; retried");
                    self.tier().stripe_failed(slot);
                    true
                }
                Ev::RecordWritten(r) => self.record_written(r),
                Ev::Merged {
                    span,
                    result,
                    reply,
                } => {
                    self.merged(span, result, reply);
                    true
                }
                Ev::Unlock(span) => {
                    self.unlock(span);
                    true
                }
                Ev::Trimmed(tickets) => {
                    self.acknowledge(tickets);
                    true
                }
                Ev::ColumnsFailed(failed) => {
                    for p in failed {
                        self.set.set_out(p);
                    }
                    true
                }
                Ev::Revived(position, r) => {
                    self.revived(position, r);
                    true
                }
                Ev::View(view) => {
                    let go_on = self.lower_view(&view);
                    self.grow_view(&view);
                    self.heal_view(*view);
                    go_on
                }
                Ev::ReadBack(back, failed) => {
                    self.read_back_done(back, failed);
                    true
                }
                Ev::ReadBackStaged(r) => self.read_back_staged(r),
                Ev::ReadBackLook => {
                    self.read_back_look();
                    true
                }
                Ev::LogTrimmed(r) => self.log_trimmed(r),
                Ev::Lowered(r) => self.lowered(r),
                Ev::GrowResized(failed) => {
                    self.grow_resized(failed);
                    true
                }
                Ev::GrowTrimmed(r) => self.grow_trimmed(r),
                Ev::GrowCommitted(to, r) => self.grow_committed(to, r),
                Ev::RebuildAsked(r) => {
                    self.rebuild_asked(r);
                    true
                }
                Ev::ColumnCopied(r) => self.column_copied(*r),
                Ev::ColumnChangeEnded { commit, result } => {
                    self.column_change_ended(commit, result)
                }
                Ev::Tick => {
                    self.idle = !std::mem::take(&mut self.busy);
                    self.revive_columns();
                    self.heal_tick();
                    let mut scan = self.written_scan;
                    let written = self.view().scan_written(&mut scan, WRITTEN_SCAN_BLOCKS);
                    self.written_scan = scan;
                    if let Some(n) = written {
                        self.written_blocks = n;
                    }
                    true
                }
                Ev::Stop => false,
            };
            if !go_on {
                break;
            }
            self.pump();
            if !quiet {
                self.publish();
            }
        }
        self.leg.stop();
        for (_, r) in std::mem::take(&mut self.tickets) {
            let _ = r.send(Err(OwnerError::Deposed));
        }
        for (_, r) in std::mem::take(&mut self.blocked) {
            let _ = r.send(Err(OwnerError::Deposed));
        }
        drop(rx);
        self.ended.set();
    }

    /// The tier's state, for the loop to read and change: locked for one
    /// call (the handles' reads wait that long at most).
    fn tier(&self) -> RwLockWriteGuard<'_, Tier> {
        self.tier.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The tier's state, to read only: the handles' reads go on beside it.
    fn view(&self) -> RwLockReadGuard<'_, Tier> {
        self.tier.read().unwrap_or_else(|e| e.into_inner())
    }

    fn io(&mut self, op: Op, reply: Reply) {
        if let Some(e) = self.refused(&op) {
            let _ = reply.send(Err(e));
            return;
        }
        let block = BLOCK_BYTES as u64;
        let aligned = |off: u64, len: u64| off.is_multiple_of(block) && len.is_multiple_of(block);
        if let Some(span) = changes(&op) {
            if self.locked(span) || self.edges_in_flight(&op) {
                self.blocked.push_back((op, reply));
                return;
            }
        }
        match op {
            Op::Read { offset, len } if aligned(offset, len.into()) => {
                self.read(offset, len, reply)
            }
            Op::Read { offset, len } => self.read_unaligned(offset, len, reply),
            Op::Write { offset, data } if aligned(offset, data.len() as u64) => {
                self.write(offset, data, reply)
            }
            Op::Write { offset, data } => self.rmw(offset, data, reply),
            Op::Zero { offset, len } if aligned(offset, len) => {
                self.zero(offset / block, len / block, reply)
            }
            Op::Zero { offset, len } => self.zero_unaligned(offset, len, reply),
            Op::Flush => {
                let done = self.leg.submit(Op::Flush);
                tokio::spawn(async move {
                    let _ = reply.send(done.wait().await);
                });
            }
            Op::Repair { component, offset } => self.repair(component, offset, reply),
            // The volume's trims are zeroings (above); this one is the
            // owner's own, to its performance leg.
            Op::Trim { .. } => {
                let _ = reply.send(Err(OwnerError::Invalid(
                    "a trim of ranges is an owner's request to its performance leg".into(),
                )));
            }
        }
    }

    /// Why `op` is refused before anything is done, if it is.
    fn refused(&self, op: &Op) -> Option<OwnerError> {
        let past_end = |off: u64, len: u64| off.checked_add(len).is_none_or(|e| e > self.size);
        match op {
            Op::Read { offset, len } if past_end(*offset, u64::from(*len)) => {
                Some(OwnerError::OutOfRange)
            }
            Op::Write { offset, data } if past_end(*offset, data.len() as u64) => {
                Some(OwnerError::OutOfRange)
            }
            Op::Zero { offset, len } if past_end(*offset, *len) => Some(OwnerError::OutOfRange),
            _ => None,
        }
    }

    /// Whether `op` is a read-modify-write whose first or last block a
    /// write not yet done is on its way to: its read could find the data
    /// from before that write, and undo it.
    fn edges_in_flight(&self, op: &Op) -> bool {
        let block = BLOCK_BYTES as u64;
        let (offset, len) = match op {
            Op::Write { offset, data } => (*offset, data.len() as u64),
            Op::Zero { offset, len } => (*offset, *len),
            _ => return false,
        };
        let end = offset + len;
        if offset.is_multiple_of(block) && end.is_multiple_of(block) {
            return false;
        }
        let (first, last) = (offset / block, end.saturating_sub(1) / block);
        let tier = self.view();
        tier.write_in_flight(first) || tier.write_in_flight(last)
    }

    /// A bad block a scrubber found: on a stripe column, rebuilt from the
    /// other columns' same row; on the performance leg, repaired by its
    /// RAID-1 loop from another copy. Answers one byte, 1 if replaced.
    fn repair(&mut self, component: shoal_model::ComponentId, offset: u64, reply: Reply) {
        let Some(position) = self.set.position_of(component) else {
            let done = self.leg.submit(Op::Repair { component, offset });
            tokio::spawn(async move {
                let _ = reply.send(done.wait().await);
            });
            return;
        };
        let set = self.set.clone();
        tokio::spawn(async move {
            let r = set.repair_block(position, offset).await;
            let _ = reply.send(
                r.map(|done| Bytes::from(vec![u8::from(done)]))
                    .map_err(column_failure),
            );
        });
    }

    /// Whether blocks `span` overlap a read-modify-write in progress.
    fn locked(&self, (first, end): (u64, u64)) -> bool {
        self.locks.iter().any(|&(f, e)| first < e && f < end)
    }

    /// The whole blocks around `offset..offset + len`, read through the
    /// routing, then cut to the request.
    fn read_unaligned(&mut self, offset: u64, len: u32, reply: Reply) {
        let block = BLOCK_BYTES as u64;
        let first = offset / block * block;
        let end = (offset + u64::from(len)).div_ceil(block) * block;
        let (tx, rx) = oneshot::channel();
        self.read(first, (end - first) as u32, tx);
        let skip = (offset - first) as usize;
        tokio::spawn(async move {
            let r = rx.await.unwrap_or(Err(OwnerError::Stopped));
            let _ = reply.send(r.map(|d| d.slice(skip..skip + len as usize)));
        });
    }

    /// A write not of whole blocks: the blocks it touches are locked
    /// (later writes to them wait), its first and last blocks read, the
    /// data laid over them, and the whole blocks written.
    fn rmw(&mut self, offset: u64, data: Bytes, reply: Reply) {
        let block = BLOCK_BYTES as u64;
        let end = offset + data.len() as u64;
        let (first, last) = (offset / block, (end - 1) / block);
        self.locks.push((first, last + 1));
        let mut edge = |b: u64| {
            let (tx, rx) = oneshot::channel();
            self.read(b * block, BLOCK_BYTES as u32, tx);
            rx
        };
        let head = edge(first);
        let tail = (last != first).then(|| edge(last));
        let tx = self.tx.clone();
        tokio::spawn(async move {
            let merged = async {
                let mut buf = BytesMut::with_capacity(((last + 1 - first) * block) as usize);
                buf.extend_from_slice(&head.await.unwrap_or(Err(OwnerError::Stopped))?);
                buf.resize(((last + 1 - first) * block) as usize, 0);
                if let Some(t) = tail {
                    let t = t.await.unwrap_or(Err(OwnerError::Stopped))?;
                    let at = buf.len() - BLOCK_BYTES;
                    buf[at..].copy_from_slice(&t);
                }
                let at = (offset - first * block) as usize;
                buf[at..at + data.len()].copy_from_slice(&data);
                Ok(buf.freeze())
            };
            let r = merged.await;
            let _ = tx.send(Ev::Merged {
                span: (first, last + 1),
                result: r,
                reply,
            });
        });
    }

    /// The read-modify-write of blocks `span` has its whole blocks: they
    /// are written, and the lock released once they are done.
    fn merged(&mut self, span: (u64, u64), result: Result<Bytes, OwnerError>, reply: Reply) {
        match result {
            Ok(data) => self.write_unlocking(span.0 * BLOCK_BYTES as u64, data, reply, Some(span)),
            Err(e) => {
                let _ = reply.send(Err(e));
                self.unlock(span);
            }
        }
    }

    /// Releases the lock on blocks `span`; the writes that waited go.
    fn unlock(&mut self, span: (u64, u64)) {
        if let Some(i) = self.locks.iter().position(|&l| l == span) {
            self.locks.swap_remove(i);
        }
        self.replay_blocked();
    }

    /// The writes that waited try again, in order.
    fn replay_blocked(&mut self) {
        for (op, reply) in std::mem::take(&mut self.blocked) {
            self.io(op, reply);
        }
    }

    /// A zeroing not of whole blocks: its partial first and last blocks
    /// are written with zeros (read-modify-write), the whole blocks
    /// between zeroed.
    fn zero_unaligned(&mut self, offset: u64, len: u64, reply: Reply) {
        let block = BLOCK_BYTES as u64;
        let end = offset + len;
        let inner = (offset.div_ceil(block), end / block);
        let mut parts = Vec::new();
        let mut part = |lp: &mut Loop, op: Op| {
            let (tx, rx) = oneshot::channel();
            lp.io(op, tx);
            parts.push(rx);
        };
        if inner.0 >= inner.1 {
            let zeros = Bytes::from(vec![0u8; len as usize]);
            part(
                self,
                Op::Write {
                    offset,
                    data: zeros,
                },
            );
        } else {
            let head = inner.0 * block - offset;
            let tail = end - inner.1 * block;
            if head > 0 {
                let zeros = Bytes::from(vec![0u8; head as usize]);
                part(
                    self,
                    Op::Write {
                        offset,
                        data: zeros,
                    },
                );
            }
            let (off, n) = (inner.0 * block, (inner.1 - inner.0) * block);
            part(
                self,
                Op::Zero {
                    offset: off,
                    len: n,
                },
            );
            if tail > 0 {
                let zeros = Bytes::from(vec![0u8; tail as usize]);
                let at = inner.1 * block;
                part(
                    self,
                    Op::Write {
                        offset: at,
                        data: zeros,
                    },
                );
            }
        }
        tokio::spawn(async move {
            let mut r = Ok(Bytes::new());
            for p in parts {
                if let Err(e) = p.await.unwrap_or(Err(OwnerError::Stopped)) {
                    r = Err(e);
                }
            }
            let _ = reply.send(r);
        });
    }

    /// Routes each block now: runs on the performance leg are sent at
    /// once (ordered with the writes sent before), stripe blocks mark
    /// their slot busy until read.
    fn read(&mut self, offset: u64, len: u32, reply: Reply) {
        let block = BLOCK_BYTES as u64;
        let (first, count) = (offset / block, u64::from(len) / block);
        let parts = route(&self.view(), &self.reading, (first, count), true);
        let Some(parts) = parts else {
            unreachable!("a read routed with the leg allowed is always routed");
        };
        let sent = send_parts(parts, Some(&self.leg));
        let (set, tx, reading) = (self.set.clone(), self.tx.clone(), self.reading.clone());
        tokio::spawn(async move {
            let _ = reply.send(gather(sent, len, (&*set, &tx, &*reading)).await);
        });
    }

    /// Whole stripes of blocks go straight to the capacity leg (as many
    /// as the write holds and [`Tier::begin_direct`] allows); the other
    /// blocks of data are staged on the performance leg, blocks of zeros
    /// zeroed. Answered once every part is.
    fn write(&mut self, offset: u64, data: Bytes, reply: Reply) {
        let (tickets, direct) = self.write_direct(offset, &data);
        // The staged part first: `answer` reports each staging done as
        // it comes, not after the stripes' tickets.
        let mut waits = match direct < data.len() {
            true => self.stage_waits(offset + direct as u64, data.slice(direct..)),
            false => Vec::new(),
        };
        waits.extend(tickets);
        tokio::spawn(answer(waits, reply, self.tx.clone(), None));
    }

    /// Begins a stripe of the client's data for each whole stripe of
    /// blocks at the start of the write, while the tier allows: the
    /// tickets to wait for, and the bytes so taken. With a column out of
    /// service nothing is (a stripe is written whole).
    fn write_direct(&mut self, offset: u64, data: &Bytes) -> (Vec<Wait>, usize) {
        let per = self.set.columns().blocks_per_stripe();
        let stripe_bytes = per * BLOCK_BYTES;
        let mut waits = Vec::new();
        let mut done = 0;
        if !self.set.whole() {
            return (waits, 0);
        }
        let mut begun: Vec<(crate::stripes::Destage, Vec<Bytes>)> = Vec::new();
        let run = (data.len() / stripe_bytes) as u64;
        while done + stripe_bytes <= data.len() {
            let first = (offset + done as u64) / BLOCK_BYTES as u64;
            let busy = self.reading.busy();
            let after = begun.last().map(|(d, _)| d.slot);
            let d = self
                .tier()
                .begin_direct(first, &busy, (after, run))
                .cloned();
            let Some(d) = d else {
                break;
            };
            let Some(ticket) = d.ticket else {
                unreachable!("a direct stripe without its ticket");
            };
            // Older staged data of these blocks is never destaged now.
            self.cache.forget(first, per as u64);
            let bytes = data.slice(done..done + stripe_bytes);
            let (tx, rx) = oneshot::channel();
            self.tickets.insert(ticket, tx);
            self.direct_data.insert(ticket, (first, bytes.clone()));
            let blocks = (0..per)
                .map(|i| bytes.slice(i * BLOCK_BYTES..(i + 1) * BLOCK_BYTES))
                .collect();
            begun.push((d, blocks));
            waits.push(Wait::Ticket(rx));
            done += stripe_bytes;
        }
        // Stripes in consecutive slots go as one write to each column.
        let mut run: Vec<(crate::stripes::Destage, Vec<Bytes>)> = Vec::new();
        for s in begun {
            let next = run.last().is_none_or(|(d, _)| d.slot + 1 == s.0.slot);
            if !next {
                self.write_direct_stripes(std::mem::take(&mut run));
            }
            run.push(s);
        }
        if !run.is_empty() {
            self.write_direct_stripes(run);
        }
        (waits, done)
    }

    /// [`Loop::write`], releasing the lock on blocks `unlock` once done:
    /// a read sent to the leg before a write there is done may find the
    /// older data, so a read-modify-write holds its blocks until then.
    fn write_unlocking(
        &mut self,
        offset: u64,
        data: Bytes,
        reply: Reply,
        unlock: Option<(u64, u64)>,
    ) {
        let waits = self.stage_waits(offset, data);
        tokio::spawn(answer(waits, reply, self.tx.clone(), unlock));
    }

    /// Stages blocks of data on the performance leg and zeroes blocks of
    /// zeros: what to wait for.
    fn stage_waits(&mut self, offset: u64, data: Bytes) -> Vec<Wait> {
        let block = BLOCK_BYTES as u64;
        let first = offset / block;
        let mut waits: Vec<Wait> = Vec::new();
        let chunks: Vec<Bytes> = (0..data.len() / BLOCK_BYTES)
            .map(|i| data.slice(i * BLOCK_BYTES..(i + 1) * BLOCK_BYTES))
            .collect();
        let mut i = 0;
        while i < chunks.len() {
            let zero = chunks[i].iter().all(|&x| x == 0);
            let mut j = i + 1;
            while j < chunks.len() && chunks[j].iter().all(|&x| x == 0) == zero {
                j += 1;
            }
            let (b, n) = (first + i as u64, (j - i) as u64);
            if zero {
                waits.extend(self.zero_blocks(b, n));
            } else {
                let seq = self.tier().stage(b, n);
                for (k, c) in chunks[i..j].iter().enumerate() {
                    self.cache.put(b + k as u64, seq, c.clone());
                }
                let d = data.slice(i * BLOCK_BYTES..j * BLOCK_BYTES);
                let w = self.leg.submit(Op::Write {
                    offset: b * block,
                    data: d,
                });
                waits.push(Wait::Staged((b, n, seq), w));
            }
            i = j;
        }
        waits
    }

    fn zero(&mut self, first: u64, count: u64, reply: Reply) {
        let waits = self.zero_blocks(first, count);
        tokio::spawn(answer(waits, reply, self.tx.clone(), None));
    }

    /// Zeroes blocks: trims what the capacity leg does not hold now, and
    /// for the rest waits for a ticket (its unmap, then its trims).
    fn zero_blocks(&mut self, first: u64, count: u64) -> Vec<Wait> {
        self.cache.forget(first, count);
        let z = self.tier().zero(first, count);
        let mut waits: Vec<Wait> = self
            .trim_runs(&z.trim_now)
            .into_iter()
            .map(Wait::Leg)
            .collect();
        if let Some(t) = z.ticket {
            let (tx, rx) = oneshot::channel();
            self.tickets.insert(t, tx);
            waits.push(Wait::Ticket(rx));
        }
        waits
    }

    /// Trims runs of blocks (first, count), in order and apart, from the
    /// performance leg: one request to each copy per
    /// `shoal_rpc::MAX_TRIM_RANGES` runs (a stripe's random blocks would
    /// otherwise cost each copy one request per block).
    fn trim_runs(&self, runs: &[(u64, u64)]) -> Vec<crate::Submitted> {
        let block = BLOCK_BYTES as u64;
        runs.chunks(shoal_rpc::MAX_TRIM_RANGES)
            .map(|chunk| match chunk {
                [(first, count)] => self.trim(*first, *count),
                _ => self.leg.submit(Op::Trim {
                    ranges: chunk.iter().map(|&(f, n)| (f * block, n * block)).collect(),
                }),
            })
            .collect()
    }

    fn trim(&self, first: u64, count: u64) -> crate::Submitted {
        let block = BLOCK_BYTES as u64;
        self.leg.submit(Op::Zero {
            offset: first * block,
            len: count * block,
        })
    }

    /// Starts what may start: the next record, the next destage.
    fn pump(&mut self) {
        self.lower_pump();
        self.grow_pump();
        if !self.recording {
            let recs = self.tier().next_records();
            if !recs.is_empty() {
                self.write_records(recs);
            }
        }
        // A stripe is written whole: with a column out, blocks stay on
        // the performance leg until it is back (or rebuilt).
        if !self.set.whole() {
            return;
        }
        let due = {
            let t = self.view();
            !t.background_in_flight() && (self.idle || t.cleaning_due() || t.stripe_destageable())
        };
        if !due {
            return;
        }
        self.idle = false;
        let busy: BTreeSet<u64> = self.reading.busy();
        let d = self.tier().begin_stripe(&busy).cloned();
        let Some(d) = d else {
            return;
        };
        self.write_stripe(d);
    }

    /// Reads the stripe's blocks (a destage's from the performance leg,
    /// sent now in order with the writes before; a clean's from the
    /// columns), encodes it and writes it whole.
    fn write_stripe(&mut self, d: crate::stripes::Destage) {
        let block = BLOCK_BYTES as u64;
        let leg_reads: Vec<Staged> = match d.from.is_empty() {
            true => d
                .blocks
                .iter()
                .map(|&(b, seq)| match self.cache.get(b, seq) {
                    Some(data) => Staged::Cached(data),
                    None => Staged::Leg(self.leg.submit(Op::Read {
                        offset: b * block,
                        len: BLOCK_BYTES as u32,
                    })),
                })
                .collect(),
            false => Vec::new(),
        };
        let (set, tx, volume) = (self.set.clone(), self.tx.clone(), self.tier_volume());
        tokio::spawn(async move {
            let mut data = Vec::with_capacity(d.blocks.len());
            for r in leg_reads {
                let r = match r {
                    Staged::Cached(data) => Ok(data),
                    Staged::Leg(w) => w.wait().await,
                };
                match r {
                    Ok(b) => data.push(b),
                    Err(e) => {
                        let _ = tx.send(Ev::StripeUnread(d.slot, e));
                        return;
                    }
                }
            }
            let moved: Vec<(u64, usize)> = d
                .from
                .iter()
                .map(|l| (l.slot, usize::from(l.index)))
                .collect();
            if !moved.is_empty() {
                // A slot's blocks on a column in one request, dead ones
                // between included.
                let read = set.read_blocks(&moved, BLOCKS_PER_UNIT).await;
                if !read.failed.is_empty() {
                    let _ = tx.send(Ev::ColumnsFailed(read.failed));
                }
                match read.data {
                    Ok(read) => data.extend(read),
                    Err(e) => {
                        let _ = tx.send(Ev::StripeUnread(d.slot, column_failure(e)));
                        return;
                    }
                }
            }
            let written = encode_and_write(&set, volume, &d, &data).await;
            let _ = tx.send(Ev::StripeWritten(d.slot, written));
        });
    }

    /// Writes stripes in consecutive slots whose data is in hand (a
    /// client's write straight to the capacity leg), one write to each
    /// column for all of them; each is written, or not, with the others.
    fn write_direct_stripes(&self, run: Vec<(crate::stripes::Destage, Vec<Bytes>)>) {
        let (set, tx, volume) = (self.set.clone(), self.tx.clone(), self.tier_volume());
        tokio::spawn(async move {
            let first = run.first().map_or(0, |(d, _)| d.slot);
            let written = match encode_run(&set, volume, &run) {
                Ok(by_column) => set.write_stripes(first, by_column).await,
                Err(e) => Err(e),
            };
            for (d, _) in &run {
                let _ = tx.send(Ev::StripeWritten(d.slot, written.clone()));
            }
        });
    }

    fn tier_volume(&self) -> u64 {
        self.view().volume()
    }

    fn stripe_written(&mut self, slot: u64, r: Result<(), ColumnError>) -> bool {
        match r {
            Ok(()) => {
                let d = self.view().stripe(slot).cloned();
                if let Some(d) = d {
                    for &(b, seq) in &d.blocks {
                        self.cache.destaged(b, seq);
                    }
                    self.direct_stripes += u64::from(d.ticket.is_some());
                }
                self.tier().stripe_written(slot);
                self.stripes_written += 1;
                true
            }
            Err(ColumnError::Deposed { .. }) => false,
            Err(e) => {
                tracing::warn!(error = %e, "stripe not written; its blocks stay on (or go to) the performance leg");
                if let ColumnError::Column { position, .. } = e {
                    self.set.set_out(position);
                }
                self.stripe_failed(slot);
                true
            }
        }
    }

    /// The stripe in slot `slot` was not written: a destage's blocks
    /// stay pending; a client's write straight to the capacity leg is
    /// staged instead, those of its blocks no client wrote or zeroed
    /// since, and answered once they are.
    fn stripe_failed(&mut self, slot: u64) {
        let failed = self.tier().stripe_failed(slot);
        let Some(failed) = failed else {
            return;
        };
        let ticket = failed.ticket;
        let Some((first, data)) = self.direct_data.remove(&ticket) else {
            return;
        };
        let reply = self.tickets.remove(&ticket);
        // Its place in the tickets' order; its answer comes from the
        // staging.
        self.acknowledge(vec![ticket]);
        let block = BLOCK_BYTES as u64;
        let mut waits = Vec::new();
        for (b, n) in failed.restage {
            let at = ((b - first) * block) as usize;
            let part = data.slice(at..at + (n * block) as usize);
            waits.extend(self.stage_waits(b * block, part));
        }
        if let Some(reply) = reply {
            tokio::spawn(answer(waits, reply, self.tx.clone(), None));
        }
        self.replay_blocked();
    }

    /// Writes records of consecutive seqs (the tier never gives a run
    /// that crosses the log's end) in one write of the leg.
    fn write_records(&mut self, recs: Vec<MapRecord>) {
        let mut data = BytesMut::with_capacity(recs.len() * BLOCK_BYTES);
        for rec in &recs {
            match rec.encode() {
                Ok(d) => data.extend_from_slice(&d),
                Err(e) => {
                    // A bug, never a client's doing: the owner stops
                    // (through the failed record's path) rather than wait
                    // for a record that is never written.
                    let e = OwnerError::Invalid(format!("map record not encodable: {e}"));
                    let _ = self.tx.send(Ev::RecordWritten(Err(e)));
                    self.recording = true;
                    return;
                }
            }
        }
        let first = recs[0].seq();
        debug_assert!(recs.iter().zip(first..).all(|(r, s)| r.seq() == s));
        self.recording = true;
        let w = self.leg.submit(Op::Write {
            offset: self.view().log_offset(first),
            data: data.freeze(),
        });
        let tx = self.tx.clone();
        tokio::spawn(async move {
            let _ = tx.send(Ev::RecordWritten(w.wait().await.map(|_| ())));
        });
    }

    /// A record is durable: apply it, send its trims at once, and
    /// acknowledge its zeroings once they are done.
    fn record_written(&mut self, r: Result<(), OwnerError>) -> bool {
        self.recording = false;
        if let Err(e) = r {
            tracing::warn!(error = %e, "map record not written: the owner stops");
            return false;
        }
        let applied = self.tier().record_durable();
        let Applied {
            trims,
            acknowledged,
        } = match applied {
            Ok(a) => a,
            Err(e) => {
                tracing::error!(error = %e, "map record not applicable: the owner stops");
                return false;
            }
        };
        // A read-modify-write may wait for a direct write just recorded.
        self.replay_blocked();
        let sent = self.trim_runs(&trims);
        let tx = self.tx.clone();
        // Acknowledged once the trims of earlier records are done too: a
        // direct write's older copy on the leg may be in one of those.
        let earlier = self.trims_done.take();
        let (done, done_rx) = oneshot::channel::<()>();
        self.trims_done = Some(done_rx);
        tokio::spawn(async move {
            for s in sent {
                // A trim that fails leaves old data on the leg: what
                // waits for it waits on (and fails with the owner, never
                // early), and so does every later record's.
                if s.wait().await.is_err() {
                    return;
                }
            }
            if let Some(e) = earlier {
                if e.await.is_err() {
                    return;
                }
            }
            let _ = done.send(());
            let _ = tx.send(Ev::Trimmed(acknowledged));
        });
        true
    }

    /// Zeroings are acknowledged in ticket order; a write straight to the
    /// capacity leg at once (its trims and every earlier record's are
    /// done, which is all a later zeroing's order guards against), so
    /// that one slow stripe does not hold back the writes after it.
    fn acknowledge(&mut self, tickets: Vec<Ticket>) {
        for t in &tickets {
            if self.direct_data.remove(t).is_some() {
                if let Some(r) = self.tickets.remove(t) {
                    let _ = r.send(Ok(Bytes::new()));
                }
            }
        }
        self.ready.extend(tickets);
        while self.ready.remove(&(self.acked_upto + 1)) {
            self.acked_upto += 1;
            if let Some(r) = self.tickets.remove(&self.acked_upto) {
                let _ = r.send(Ok(Bytes::new()));
            }
        }
    }

    /// On a tick: tries the columns out of service again, every
    /// [`COLUMN_RETRY_MS`].
    fn revive_columns(&mut self) {
        let due = self
            .revived_at
            .is_none_or(|t| t.elapsed() >= Duration::from_millis(COLUMN_RETRY_MS));
        if !due {
            return;
        }
        self.revived_at = Some(Instant::now());
        let service = self.set.in_service();
        for position in 0..self.set.columns().width() {
            // A column being rebuilt elsewhere stays out: the new one
            // replaces it.
            if service.contains(&position)
                || self.heal.replacing() == Some(position)
                || !self.reviving.insert(position)
            {
                continue;
            }
            let (set, tx) = (self.set.clone(), self.tx.clone());
            tokio::spawn(async move {
                let r = set.revive(position).await;
                let _ = tx.send(Ev::Revived(position, r));
            });
        }
    }

    fn revived(&mut self, position: usize, r: Result<(), ColumnError>) {
        self.reviving.remove(&position);
        match r {
            Ok(()) => tracing::info!(position, "stripe column back in service"),
            Err(e) => tracing::debug!(position, error = %e, "stripe column still out"),
        }
    }

    /// Publishes the capacity leg's figures for the status readers.
    fn publish(&self) {
        let width = self.set.columns().width();
        let targets: Vec<ColumnTarget> =
            (0..width).filter_map(|p| self.set.target(p).ok()).collect();
        let s = TierStatus {
            staged_blocks: self.view().pending_blocks() as u64,
            columns_out: (width - self.set.in_service().len()) as u64,
            stripes_written: self.stripes_written,
            direct_stripes: self.direct_stripes,
            written_bytes: self.written_blocks * BLOCK_BYTES as u64,
            waiting: self.heal.waiting(&targets),
            copy: self.heal.copy(),
            cannot_rebuild: self.heal.problem(),
        };
        let mut st = self.status.lock().unwrap_or_else(|e| e.into_inner());
        *st = s;
    }
}

/// Encodes a stripe of `data` (its blocks' data, in the order of
/// `d.blocks`) and writes it whole into its slot.
async fn encode_and_write(
    set: &ColumnSet,
    volume: u64,
    d: &crate::stripes::Destage,
    data: &[Bytes],
) -> Result<(), ColumnError> {
    let units = encode(set, volume, d, data)?;
    set.write_stripe(d.slot, units).await
}

/// The `k + m` units of stripe `d` of `data`, by column.
fn encode(
    set: &ColumnSet,
    volume: u64,
    d: &crate::stripes::Destage,
    data: &[Bytes],
) -> Result<Vec<Vec<u8>>, ColumnError> {
    let numbers: Vec<u64> = d.blocks.iter().map(|&(b, _)| b).collect();
    let summary = summary_of(set.columns(), volume, (d.stripe_seq, d.slot), &numbers);
    let refs: Vec<&[u8]> = data.iter().map(|d| &d[..]).collect();
    Ok(set.columns().encode(set.codec(), &summary, &refs)?)
}

/// Stripes in consecutive slots, each with its blocks' data, by column:
/// each column's units of all of them in one buffer.
fn encode_run(
    set: &ColumnSet,
    volume: u64,
    run: &[(crate::stripes::Destage, Vec<Bytes>)],
) -> Result<Vec<Vec<u8>>, ColumnError> {
    let stripes: Vec<(crate::stripes::Summary, Vec<&[u8]>)> = run
        .iter()
        .map(|(d, data)| {
            let numbers: Vec<u64> = d.blocks.iter().map(|&(b, _)| b).collect();
            let summary = summary_of(set.columns(), volume, (d.stripe_seq, d.slot), &numbers);
            (summary, data.iter().map(|b| &b[..]).collect())
        })
        .collect();
    let refs: Vec<(&crate::stripes::Summary, &[&[u8]])> =
        stripes.iter().map(|(s, d)| (s, &d[..])).collect();
    Ok(set.columns().encode_run(set.codec(), &refs)?)
}

/// Stripe slots with reads in flight, shared by the loop, which counts a
/// read in when it routes one to a slot, and the reads' tasks, which
/// count it out once its data came back: a slot with reads in flight is
/// never chosen for a new stripe (`Tier::begin_stripe`'s `busy`), so a
/// read never finds a newer stripe's data. Shared rather than reported
/// back as events: one loop event less per block read.
#[derive(Default)]
struct SlotReads(Mutex<BTreeMap<u64, u32>>);

impl SlotReads {
    fn begin(&self, slot: u64) {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry(slot).or_default() += 1;
    }

    fn end(&self, slot: u64) {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&slot) {
            debug_assert!(*n > 0, "slot {slot} read ended more than begun");
            *n -= 1;
            if *n == 0 {
                m.remove(&slot);
            }
        }
    }

    fn busy(&self) -> BTreeSet<u64> {
        let m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.keys().copied().collect()
    }
}

/// A destaged block's data: kept from its write, or read from the leg.
enum Staged {
    Cached(Bytes),
    Leg(crate::Submitted),
}

/// [`Loop::cache`].
#[derive(Default)]
struct WriteCache {
    blocks: std::collections::HashMap<u64, (u64, Bytes)>,
}

impl WriteCache {
    /// Keeps block `b` as write `seq` put it, if there is room (a newer
    /// write replaces an older one).
    fn put(&mut self, b: u64, seq: u64, data: Bytes) {
        debug_assert_eq!(data.len(), BLOCK_BYTES);
        let full = self.blocks.len() * BLOCK_BYTES >= WRITE_CACHE_BYTES;
        if full && !self.blocks.contains_key(&b) {
            // An older write's data must not stand for this one.
            return;
        }
        self.blocks.insert(b, (seq, data));
    }

    /// Block `b` as write `seq` put it, if kept.
    fn get(&self, b: u64, seq: u64) -> Option<Bytes> {
        match self.blocks.get(&b) {
            Some((s, d)) if *s == seq => Some(d.clone()),
            _ => None,
        }
    }

    /// Write `seq` of block `b` is destaged: no longer needed.
    fn destaged(&mut self, b: u64, seq: u64) {
        if self.blocks.get(&b).is_some_and(|(s, _)| *s == seq) {
            self.blocks.remove(&b);
        }
    }

    /// Blocks zeroed: what was kept of them is stale.
    fn forget(&mut self, first: u64, count: u64) {
        if count as usize > self.blocks.len() {
            self.blocks
                .retain(|b, _| !(first..first + count).contains(b));
        } else {
            for b in first..first + count {
                self.blocks.remove(&b);
            }
        }
    }
}

enum Part {
    Leg(u64, u64),
    Zeros,
    Stripe(u64, usize),
}

enum Sent {
    Leg(crate::Submitted),
    Zeros,
    Stripe(u64, usize),
}

/// How blocks `first..first + count` are read, as the tier has them
/// now: runs from the performance leg, zeros, and stripe blocks, each
/// stripe block's slot counted in `reading` (out again by [`read_part`]).
/// With `leg` false, None if any block is on the leg, nothing counted in:
/// the read goes through the loop.
fn route(
    tier: &Tier,
    reading: &SlotReads,
    (first, count): (u64, u64),
    leg: bool,
) -> Option<Vec<Part>> {
    let mut parts: Vec<Part> = Vec::new();
    for b in first..first + count {
        match (tier.source(b), parts.last_mut()) {
            (Source::Performance, _) if !leg => return None,
            (Source::Performance, Some(Part::Leg(f, n))) if *f + *n == b => *n += 1,
            (Source::Performance, _) => parts.push(Part::Leg(b, 1)),
            (Source::Zeros, _) => parts.push(Part::Zeros),
            (Source::Stripe(loc), _) => parts.push(Part::Stripe(loc.slot, usize::from(loc.index))),
        }
    }
    for p in &parts {
        if let Part::Stripe(slot, _) = p {
            reading.begin(*slot);
        }
    }
    Some(parts)
}

/// A read's parts as sent: runs on the leg submitted to `leg` (only the
/// loop passes it: a read routed without the leg has none).
fn send_parts(parts: Vec<Part>, leg: Option<&Owner>) -> Vec<Sent> {
    let block = BLOCK_BYTES as u64;
    let leg_read = |f: u64, n: u64| match leg {
        Some(leg) => Sent::Leg(leg.submit(Op::Read {
            offset: f * block,
            len: (n * block) as u32,
        })),
        None => unreachable!("a read routed without the leg has a leg part"),
    };
    parts
        .into_iter()
        .map(|p| match p {
            Part::Leg(f, n) => leg_read(f, n),
            Part::Zeros => Sent::Zeros,
            Part::Stripe(slot, index) => Sent::Stripe(slot, index),
        })
        .collect()
}

/// The data of a read of `len` bytes sent as `sent`, in order.
async fn gather(
    sent: Vec<Sent>,
    len: u32,
    ends: (&ColumnSet, &mpsc::UnboundedSender<Ev>, &SlotReads),
) -> Result<Bytes, OwnerError> {
    if let [_] = &sent[..] {
        // One part (a small read): its data as it comes.
        let part = sent.into_iter().next().map(|s| read_part(s, ends));
        return match part {
            Some(part) => part.await,
            None => Err(OwnerError::Invalid("an empty read".into())),
        };
    }
    // Every part at once: a read over many destaged blocks waits for one
    // round trip to the columns, not one per block, and the stripe
    // blocks next to each other on a column go as one request.
    let (set, tx, reading) = ends;
    let mut locs: Vec<(u64, usize)> = Vec::new();
    let mut legs = Vec::new();
    let mut kinds: Vec<Kind> = Vec::with_capacity(sent.len());
    for s in sent {
        match s {
            Sent::Leg(w) => {
                legs.push(w.wait());
                kinds.push(Kind::Leg);
            }
            Sent::Zeros => kinds.push(Kind::Zeros),
            Sent::Stripe(slot, index) => {
                locs.push((slot, index));
                kinds.push(Kind::Stripe);
            }
        }
    }
    let stripes = async {
        if locs.is_empty() {
            return BlockReads {
                data: Ok(Vec::new()),
                failed: Vec::new(),
            };
        }
        set.read_blocks(&locs, 0).await
    };
    let (stripes, legs) = futures::join!(stripes, futures::future::join_all(legs));
    for &(slot, _) in &locs {
        reading.end(slot);
    }
    if !stripes.failed.is_empty() {
        let _ = tx.send(Ev::ColumnsFailed(stripes.failed));
    }
    let stripes = stripes.data.map_err(column_failure)?;
    let (mut from_stripes, mut from_legs) = (stripes.into_iter(), legs.into_iter());
    let mut out = BytesMut::with_capacity(len as usize);
    for kind in kinds {
        let data = match kind {
            Kind::Leg => from_legs.next().unwrap_or_else(|| Err(lost("leg")))?,
            Kind::Stripe => from_stripes.next().ok_or_else(|| lost("stripe"))?,
            Kind::Zeros => Bytes::from_static(&[0u8; BLOCK_BYTES]),
        };
        out.extend_from_slice(&data);
    }
    Ok(out.freeze())
}

/// A read's part, as [`gather`] puts the parts back in order.
enum Kind {
    Leg,
    Zeros,
    Stripe,
}

/// A part missing from what was read for it (never: each part's read
/// gives one block).
fn lost(what: &str) -> OwnerError {
    OwnerError::Invalid(format!("a {what} part of a read lost its data"))
}

/// One part of a read: from the leg, zeros, or a stripe block (its
/// slot's read then counted out, and the columns that failed reported to
/// the loop).
async fn read_part(
    s: Sent,
    (set, tx, reading): (&ColumnSet, &mpsc::UnboundedSender<Ev>, &SlotReads),
) -> Result<Bytes, OwnerError> {
    match s {
        Sent::Leg(w) => w.wait().await,
        Sent::Zeros => Ok(Bytes::from_static(&[0u8; BLOCK_BYTES])),
        Sent::Stripe(slot, index) => {
            let r = set.read_block(slot, index).await;
            reading.end(slot);
            let failed = r.as_ref().map(|r| r.failed.clone()).unwrap_or_default();
            if !failed.is_empty() {
                let _ = tx.send(Ev::ColumnsFailed(failed));
            }
            r.map(|r| r.data).map_err(column_failure)
        }
    }
}

enum Wait {
    Leg(crate::Submitted),
    /// A write staging blocks (first, count) as write `seq`.
    Staged((u64, u64, u64), crate::Submitted),
    Ticket(oneshot::Receiver<Result<Bytes, OwnerError>>),
}

/// Answers a write or zeroing once all its parts are done, and tells the
/// loop which staged writes are done and which lock to release.
async fn answer(
    waits: Vec<Wait>,
    reply: Reply,
    tx: mpsc::UnboundedSender<Ev>,
    unlock: Option<(u64, u64)>,
) {
    let mut result = Ok(Bytes::new());
    for w in waits {
        let r = match w {
            Wait::Leg(s) => s.wait().await,
            Wait::Staged(staged, s) => {
                // Over either way: what the leg holds now is what a
                // destage or a read-modify-write reads.
                let r = s.wait().await;
                let _ = tx.send(Ev::Staged(staged));
                r
            }
            Wait::Ticket(rx) => rx.await.unwrap_or(Err(OwnerError::Deposed)),
        };
        if let Err(e) = r {
            result = Err(e);
        }
    }
    if let Some(span) = unlock {
        let _ = tx.send(Ev::Unlock(span));
    }
    let _ = reply.send(result);
}
