//! The capacity leg's stripe columns over RPC, for the owner of an
//! erasure-coded volume (`docs/erasure-coding.md`): taking the columns
//! over under the owner's generation, writing a stripe whole, and reading
//! a block from its column, or rebuilding it from the same row of `k`
//! other columns when that column is out or fails (a degraded read).
//!
//! Owns the connections to the columns and which of them are in service.
//! Never decides what to write where: [`crate::stripes::Tier`] does, and
//! [`crate::stripes::Columns`] says where a block sits.

use crate::stripes::{Columns, StripeError, BLOCK_BYTES, UNIT_BYTES};
use bytes::Bytes;
use futures::future::join_all;
use shoal_erasure::{Codec, Geometry};
use shoal_model::{ComponentId, DeviceId, Generation, StripeGeometry, VolumeId};
use shoal_rpc::{Peer, PeerAuth, RemoteError, Request, RpcError};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// One stripe column: its component and where to reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColumnTarget {
    pub component: ComponentId,
    /// The device the column is placed on.
    pub device: DeviceId,
    /// Peer RPC address of the column's node.
    pub addr: String,
}

/// Why a column operation failed. Callers branch on it: `Deposed` means
/// another owner took the volume over.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ColumnError {
    #[error("a newer owner activated column {position}")]
    Deposed { position: usize },
    #[error("{have} stripe columns in service; {need} needed")]
    TooFewColumns { have: usize, need: usize },
    #[error("column {position}: {error}")]
    Column { position: usize, error: RpcError },
    #[error(transparent)]
    Stripe(#[from] StripeError),
    #[error("{got} columns given for a stripe of {want}")]
    Width { want: usize, got: usize },
    #[error("column {position} is in service: it is not rebuilt")]
    InService { position: usize },
    /// A caller's mistake: the columns' shares of a run of stripes must
    /// be whole units, the same on every column.
    #[error("a run of stripes given as {lens:?} bytes by column")]
    Units { lens: Vec<usize> },
}

/// A read of one block: its data, and the columns that failed on the way
/// (to take out of service).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockRead {
    pub data: Bytes,
    pub failed: Vec<usize>,
}

/// A block of a span read: where the caller wants it, its index in its
/// stripe, and its byte offset in its column.
struct SpanBlock {
    at: usize,
    index: usize,
    offset: u64,
}

/// Blocks `(slot, index)` as runs to read with one request each: by
/// slot and column, in offset order, a new run wherever the next block is
/// more than `gap` blocks past the last.
fn spans(
    columns: &Columns,
    locs: &[(u64, usize)],
    gap: usize,
) -> Vec<(u64, usize, Vec<SpanBlock>)> {
    let mut by_column: std::collections::BTreeMap<(u64, usize), Vec<SpanBlock>> =
        std::collections::BTreeMap::new();
    for (at, &(slot, index)) in locs.iter().enumerate() {
        let (position, offset) = columns.block_at(slot, index);
        let b = SpanBlock { at, index, offset };
        by_column.entry((slot, position)).or_default().push(b);
    }
    let far = (gap as u64 + 1) * BLOCK_BYTES as u64;
    let mut out: Vec<(u64, usize, Vec<SpanBlock>)> = Vec::new();
    for ((slot, position), mut blocks) in by_column {
        blocks.sort_unstable_by_key(|b| b.offset);
        for b in blocks {
            match out.last_mut() {
                Some((s, p, run))
                    if (*s, *p) == (slot, position)
                        && run.last().is_some_and(|l| b.offset - l.offset <= far) =>
                {
                    run.push(b)
                }
                _ => out.push((slot, position, vec![b])),
            }
        }
    }
    out
}

/// A read of many blocks ([`ColumnSet::read_blocks`]): their data in
/// the order asked (or why not), and the columns that failed on the way
/// either way.
#[derive(Debug)]
pub struct BlockReads {
    pub data: Result<Vec<Bytes>, ColumnError>,
    pub failed: Vec<usize>,
}

/// The columns of one owned volume's capacity leg.
pub struct ColumnSet {
    columns: Columns,
    codec: Arc<Codec>,
    generation: Generation,
    /// How long one column may take to answer, as for copies.
    timeout: Duration,
    /// By position: the column (replaced when a lost one is rebuilt).
    targets: RwLock<Vec<ColumnTarget>>,
    /// How the owner proves itself to the columns' nodes, to reconnect.
    auth: PeerAuth,
    /// By position: the connection of a column in service.
    peers: RwLock<Vec<Option<Arc<Peer>>>>,
    /// Bytes each column has room for: a column taken back into service
    /// is grown to it (one out of service during a growth missed it).
    column_bytes: AtomicU64,
    /// Held while a growth raises `column_bytes` and takes the columns in
    /// service to grow, and while a column is taken back into service at
    /// the size it was grown to: either the growth grows it, or it is
    /// grown to the new size before it serves.
    growing: std::sync::Mutex<()>,
}

impl ColumnSet {
    /// Connects to every column (by position) of volume `volume` of
    /// `volume_bytes`, with `create` makes sure it exists
    /// ([`Columns::column_bytes`] long), and activates it under
    /// `generation`, all at once. A column that cannot be reached, or
    /// that its node does not have and is not to be created, is out of
    /// service; fewer than `k` in service is refused, and a column that
    /// already has a newer owner deposes this one.
    pub async fn activate(
        geometry: StripeGeometry,
        (volume, volume_bytes): (VolumeId, u64),
        targets: Vec<ColumnTarget>,
        (generation, create): (Generation, bool),
        timeout: Duration,
        auth: &PeerAuth,
    ) -> Result<ColumnSet, ColumnError> {
        let g = Geometry::of(geometry).map_err(StripeError::from)?;
        let columns = Columns::new(g);
        if targets.len() != columns.width() {
            return Err(ColumnError::Width {
                want: columns.width(),
                got: targets.len(),
            });
        }
        let codec = Arc::new(Codec::new(g).map_err(StripeError::from)?);
        let size = columns.column_bytes(volume_bytes);
        let tries = targets
            .iter()
            .map(|t| activate_one(t, (volume, size, create), generation, timeout, auth));
        let mut peers = Vec::with_capacity(targets.len());
        for (position, r) in join_all(tries).await.into_iter().enumerate() {
            match r {
                Ok(p) => peers.push(Some(Arc::new(p))),
                Err(RpcError::Remote(RemoteError::StaleGeneration { .. })) => {
                    return Err(ColumnError::Deposed { position })
                }
                Err(e) => {
                    tracing::warn!(position, error = %e, "stripe column out of service");
                    peers.push(None);
                }
            }
        }
        let set = ColumnSet {
            columns,
            codec,
            generation,
            timeout,
            targets: RwLock::new(targets),
            auth: auth.clone(),
            peers: RwLock::new(peers),
            column_bytes: AtomicU64::new(size),
            growing: std::sync::Mutex::new(()),
        };
        set.need(usize::from(geometry.data))?;
        Ok(set)
    }

    pub fn columns(&self) -> &Columns {
        &self.columns
    }

    pub fn codec(&self) -> &Codec {
        &self.codec
    }

    /// Positions of the columns in service.
    pub fn in_service(&self) -> Vec<usize> {
        let peers = self.peers.read().unwrap_or_else(|e| e.into_inner());
        (0..peers.len()).filter(|&p| peers[p].is_some()).collect()
    }

    /// Grows every column to `column_bytes` (a growth of the volume): the
    /// positions that failed, to be taken out of service (those out of
    /// service already are grown when taken back).
    pub async fn grow(&self, column_bytes: u64) -> Vec<usize> {
        let positions = {
            let _held = self.growing.lock().unwrap_or_else(|e| e.into_inner());
            self.column_bytes.fetch_max(column_bytes, Ordering::SeqCst);
            self.in_service()
        };
        let tries = positions.into_iter().map(|position| async move {
            let done = match (self.peer(position), self.component(position)) {
                (Ok(peer), Ok(component)) => {
                    grow_one(&peer, component, column_bytes, self.timeout).await
                }
                _ => Err(RpcError::Closed),
            };
            match done {
                Ok(()) => None,
                Err(e) => {
                    tracing::warn!(position, error = %e, "stripe column not grown: out of service");
                    Some(position)
                }
            }
        });
        join_all(tries).await.into_iter().flatten().collect()
    }

    /// Takes column `position` out of service (it failed).
    pub fn set_out(&self, position: usize) {
        let mut peers = self.peers.write().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = peers.get_mut(position) {
            *p = None;
        }
    }

    /// Brings column `position`, out of service, back in once its node
    /// answers an activation under this owner's generation. Nothing is
    /// written to the columns while one is out (a stripe is written
    /// whole), so it still holds every stripe the map refers to. It is
    /// not created: a column its node no longer has stays out (it is
    /// rebuilt elsewhere, not filled with zeros).
    pub async fn revive(&self, position: usize) -> Result<(), ColumnError> {
        let t = self.target(position)?;
        let peer = Peer::connect(&t.addr, self.timeout, &self.auth)
            .await
            .map_err(|e| column_error(position, e))?;
        let req = Request::Activate {
            component: t.component,
            generation: self.generation,
        };
        peer.call(&req, Bytes::new(), self.timeout)
            .await
            .map_err(|e| column_error(position, e))?;
        let mut size = self.column_bytes.load(Ordering::SeqCst);
        loop {
            grow_one(&peer, t.component, size, self.timeout)
                .await
                .map_err(|e| column_error(position, e))?;
            let _held = self.growing.lock().unwrap_or_else(|e| e.into_inner());
            let now = self.column_bytes.load(Ordering::SeqCst);
            if now <= size {
                let mut peers = self.peers.write().unwrap_or_else(|e| e.into_inner());
                if let Some(p) = peers.get_mut(position) {
                    *p = Some(Arc::new(peer));
                }
                return Ok(());
            }
            // A growth began meanwhile, without this column: grown to its
            // size before it serves.
            size = now;
        }
    }

    /// Whether every column is in service: only then is a stripe written.
    pub fn whole(&self) -> bool {
        self.in_service().len() == self.columns.width()
    }

    fn need(&self, need: usize) -> Result<(), ColumnError> {
        let have = self.in_service().len();
        match have >= need {
            true => Ok(()),
            false => Err(ColumnError::TooFewColumns { have, need }),
        }
    }

    /// Writes the `k + m` units of a stripe (by column, from
    /// [`Columns::encode`]) at slot `slot`, all in flight at once, each
    /// with its blocks' CRC-32C; returns once every one is durable. Every
    /// column must be in service: a stripe is written whole.
    pub async fn write_stripe(&self, slot: u64, units: Vec<Vec<u8>>) -> Result<(), ColumnError> {
        self.write_stripes(slot, units).await
    }

    /// Writes stripes in consecutive slots from `first`, by column (as
    /// [`Columns::encode_run`] gives them: each column's units of every
    /// stripe, neighbours on the column), one write to each column: one
    /// request, and one sync, per column instead of one per unit.
    /// Returns once every one is durable.
    pub async fn write_stripes(
        &self,
        first: u64,
        by_column: Vec<Vec<u8>>,
    ) -> Result<(), ColumnError> {
        let width = self.columns.width();
        if by_column.len() != width {
            return Err(ColumnError::Width {
                want: width,
                got: by_column.len(),
            });
        }
        self.need(width)?;
        let len = by_column.first().map_or(0, Vec::len);
        let whole = by_column.iter().all(|u| u.len() == len)
            && (len as u64).is_multiple_of(UNIT_BYTES)
            && len > 0;
        if !whole {
            return Err(ColumnError::Units {
                lens: by_column.iter().map(Vec::len).collect(),
            });
        }
        let mut pending = Vec::with_capacity(width);
        for (position, unit) in by_column.into_iter().enumerate() {
            let req = Request::WriteChecked {
                component: self.component(position)?,
                generation: self.generation,
                offset: first * UNIT_BYTES,
                seq: 0,
                crcs: unit.chunks(BLOCK_BYTES).map(crc32c::crc32c).collect(),
            };
            let sent = self.peer(position)?.send(&req, Bytes::from(unit));
            pending.push((position, sent));
        }
        let waits = pending.into_iter().map(|(position, sent)| async move {
            let r = match sent {
                Ok(p) => p.wait(self.timeout).await.map(|_| ()),
                Err(e) => Err(e),
            };
            r.map_err(|e| column_error(position, e))
        });
        join_all(waits).await.into_iter().collect()
    }

    /// Reads block index `index` of the stripe in `slot`: from its column,
    /// or, with that column out or failing, rebuilt from the same row of
    /// `k` others.
    ///
    /// A block that fails its checksum is rebuilt too, and its column
    /// stays in service: one bad block is the scrubber's to repair
    /// ([`ColumnSet::repair_block`]), not a failed device.
    pub async fn read_block(&self, slot: u64, index: usize) -> Result<BlockRead, ColumnError> {
        let (position, offset) = self.columns.block_at(slot, index);
        let mut failed = Vec::new();
        if self.peer(position).is_ok() {
            match self.read_row(position, offset).await {
                Ok(data) => return Ok(BlockRead { data, failed }),
                Err(ColumnError::Deposed { position }) => {
                    return Err(ColumnError::Deposed { position })
                }
                Err(e) => {
                    tracing::warn!(error = %e, "stripe column read failed: rebuilding the block");
                    if !is_bad_block(&e) {
                        failed.push(position);
                    }
                }
            }
        }
        let data = self.rebuild(slot, position, offset, &mut failed).await?;
        Ok(BlockRead { data, failed })
    }

    /// Blocks `(slot, index)` of stripes, in the order asked, with the
    /// columns that failed on the way (to take out of service), reported
    /// whether the read succeeds or not. Blocks of one slot on one column
    /// at most `gap` blocks apart are read in one request spanning them
    /// (at most a unit's 31 blocks, those between included): a read of
    /// many destaged blocks, or a clean of a few slots, costs a round trip
    /// and a node request per run, not per block. A span that fails is
    /// read again block by block: rebuilt from the other columns at once
    /// if its column failed, else (a bad block) each from the column, the
    /// bad one rebuilt, as [`ColumnSet::read_block`] does.
    pub async fn read_blocks(&self, locs: &[(u64, usize)], gap: usize) -> BlockReads {
        let reads = spans(&self.columns, locs, gap)
            .into_iter()
            .map(|(slot, position, blocks)| self.read_span(slot, position, blocks));
        let mut out: Vec<Option<Bytes>> = vec![None; locs.len()];
        let mut failed = Vec::new();
        let mut error = None;
        for (blocks, lost) in join_all(reads).await {
            failed.extend(lost);
            match blocks {
                Ok(blocks) => {
                    for (at, data) in blocks {
                        out[at] = Some(data);
                    }
                }
                // A deposed owner's error first: it stops the owner.
                Err(e) if error.is_none() || matches!(e, ColumnError::Deposed { .. }) => {
                    error = Some(e)
                }
                Err(_) => {}
            }
        }
        failed.sort_unstable();
        failed.dedup();
        let data = match error {
            Some(e) => Err(e),
            None => {
                let data: Vec<Bytes> = out.into_iter().flatten().collect();
                assert_eq!(data.len(), locs.len(), "a block asked for was not read");
                Ok(data)
            }
        };
        BlockReads { data, failed }
    }

    /// The blocks of slot `slot` on column `position`, in offset order:
    /// one read from the first to the last, else each on its own. The
    /// blocks read, by where the caller wants them, and the columns that
    /// failed.
    async fn read_span(
        &self,
        slot: u64,
        position: usize,
        blocks: Vec<SpanBlock>,
    ) -> (Result<Vec<(usize, Bytes)>, ColumnError>, Vec<usize>) {
        let lo = blocks.first().map_or(0, |b| b.offset);
        let hi = blocks.last().map_or(0, |b| b.offset) + BLOCK_BYTES as u64;
        assert!(
            hi - lo <= UNIT_BYTES,
            "a span of one slot's unit is within it"
        );
        let mut failed = Vec::new();
        if blocks.len() > 1 && self.peer(position).is_ok() {
            match self.read_at(position, lo, (hi - lo) as u32).await {
                Ok(data) => {
                    let at = |b: &SpanBlock| (b.offset - lo) as usize;
                    let cut = |b: &SpanBlock| data.slice(at(b)..at(b) + BLOCK_BYTES);
                    return (Ok(blocks.iter().map(|b| (b.at, cut(b))).collect()), failed);
                }
                Err(ColumnError::Deposed { position }) => {
                    return (Err(ColumnError::Deposed { position }), failed)
                }
                Err(e) if is_bad_block(&e) => {
                    tracing::warn!(error = %e, "a bad block in a stripe column read: block by block")
                }
                Err(e) => {
                    tracing::warn!(error = %e, "stripe column read failed: rebuilding its blocks");
                    failed.push(position);
                    return self.rebuild_span(slot, position, &blocks, failed).await;
                }
            }
        }
        let reads = blocks.iter().map(|b| self.read_block(slot, b.index));
        let mut out = Vec::with_capacity(blocks.len());
        let mut error = None;
        for (b, r) in blocks.iter().zip(join_all(reads).await) {
            match r {
                Ok(r) => {
                    failed.extend(r.failed);
                    out.push((b.at, r.data));
                }
                Err(e) => error = Some(e),
            }
        }
        (error.map_or(Ok(out), Err), failed)
    }

    /// The blocks of a span whose column `position` failed, each rebuilt
    /// from the other columns without asking that column again.
    async fn rebuild_span(
        &self,
        slot: u64,
        position: usize,
        blocks: &[SpanBlock],
        mut failed: Vec<usize>,
    ) -> (Result<Vec<(usize, Bytes)>, ColumnError>, Vec<usize>) {
        let mut out = Vec::with_capacity(blocks.len());
        for b in blocks {
            match self.rebuild(slot, position, b.offset, &mut failed).await {
                Ok(data) => out.push((b.at, data)),
                Err(e) => return (Err(e), failed),
            }
        }
        (Ok(out), failed)
    }

    /// Replaces the 4 KiB at byte `offset` of column `position`, which
    /// failed its checksum (found by a scrubber), with its row rebuilt
    /// from the other columns, if it still fails it. Answers whether it
    /// was replaced.
    pub async fn repair_block(&self, position: usize, offset: u64) -> Result<bool, ColumnError> {
        let offset = offset / BLOCK_BYTES as u64 * BLOCK_BYTES as u64;
        let slot = offset / UNIT_BYTES;
        let row = self
            .rebuild(slot, position, offset, &mut Vec::new())
            .await?;
        let req = Request::Repair {
            component: self.component(position)?,
            generation: self.generation,
            offset,
        };
        let answer = self
            .peer(position)?
            .call(&req, row, self.timeout)
            .await
            .map_err(|e| column_error(position, e))?;
        Ok(matches!(answer.0, shoal_rpc::Response::Repaired(true)))
    }

    /// The position of column component `component`, if it is one.
    pub fn position_of(&self, component: ComponentId) -> Option<usize> {
        let targets = self.targets.read().unwrap_or_else(|e| e.into_inner());
        targets.iter().position(|t| t.component == component)
    }

    /// Rebuilds the row at `offset` of column `lost` from the other
    /// columns in service (those that fail, other than by a bad block,
    /// join `failed`).
    async fn rebuild(
        &self,
        slot: u64,
        lost: usize,
        offset: u64,
        failed: &mut Vec<usize>,
    ) -> Result<Bytes, ColumnError> {
        let others: Vec<usize> = self
            .in_service()
            .into_iter()
            .filter(|p| *p != lost && !failed.contains(p))
            .collect();
        let reads = others.iter().map(|&p| self.read_row(p, offset));
        let mut rows: Vec<Option<Vec<u8>>> = vec![None; self.columns.width()];
        for (&p, r) in others.iter().zip(join_all(reads).await) {
            match r {
                Ok(d) => rows[p] = Some(d.to_vec()),
                Err(ColumnError::Deposed { position }) => {
                    return Err(ColumnError::Deposed { position })
                }
                // A bad block of another column: its row is missing here,
                // the column stays in service.
                Err(e) if is_bad_block(&e) => {}
                Err(_) => failed.push(p),
            }
        }
        let have = rows.iter().flatten().count();
        let need = self.columns.data_units();
        if have < need {
            return Err(ColumnError::TooFewColumns { have, need });
        }
        let mut whole = self.columns.rebuild_row(&self.codec, slot, rows)?;
        Ok(Bytes::from(std::mem::take(&mut whole[lost])))
    }

    async fn read_row(&self, position: usize, offset: u64) -> Result<Bytes, ColumnError> {
        self.read_at(position, offset, BLOCK_BYTES as u32).await
    }

    /// `len` bytes at `offset` of column `position`.
    async fn read_at(&self, position: usize, offset: u64, len: u32) -> Result<Bytes, ColumnError> {
        let req = Request::Read {
            component: self.component(position)?,
            generation: self.generation,
            offset,
            len,
        };
        let (_, data) = self
            .peer(position)?
            .call(&req, Bytes::new(), self.timeout)
            .await
            .map_err(|e| column_error(position, e))?;
        if data.len() != len as usize {
            let e = RpcError::Protocol(format!("a read of {len} bytes answered {}", data.len()));
            return Err(ColumnError::Column { position, error: e });
        }
        Ok(data)
    }

    /// The column at `position` now.
    pub fn target(&self, position: usize) -> Result<ColumnTarget, ColumnError> {
        let targets = self.targets.read().unwrap_or_else(|e| e.into_inner());
        targets.get(position).cloned().ok_or(ColumnError::Width {
            want: self.columns.width(),
            got: position + 1,
        })
    }

    /// The component of the column at `position` now: [`ColumnSet::target`]
    /// without copying its address, for every request.
    fn component(&self, position: usize) -> Result<ComponentId, ColumnError> {
        let targets = self.targets.read().unwrap_or_else(|e| e.into_inner());
        let t = targets.get(position).ok_or(ColumnError::Width {
            want: self.columns.width(),
            got: position + 1,
        })?;
        Ok(t.component)
    }

    /// Fills `new`, the column rebuilt in place of lost column
    /// `position` (out of service), with that column's unit of every
    /// stripe slot of `slots`, recomputed from the same slot of `k` other
    /// columns (row by row, around bad blocks, when a whole unit cannot
    /// be read). The column is created and activated under this owner's
    /// generation first. Counts the bytes written in `copied`; answers the
    /// new column's connection, to [`ColumnSet::replace`] it in once the
    /// change is committed.
    pub async fn copy_column(
        &self,
        position: usize,
        new: &ColumnTarget,
        (volume, volume_bytes): (VolumeId, u64),
        slots: &[u64],
        copied: &std::sync::atomic::AtomicU64,
    ) -> Result<Peer, ColumnError> {
        if self.peer(position).is_ok() {
            return Err(ColumnError::InService { position });
        }
        let size = self.columns.column_bytes(volume_bytes);
        let peer = activate_one(
            new,
            (volume, size, true),
            self.generation,
            self.timeout,
            &self.auth,
        )
        .await
        .map_err(|e| column_error(position, e))?;
        for &slot in slots {
            let unit = match self.rebuild_unit(slot, position).await {
                Ok(u) => u,
                Err(ColumnError::Deposed { position }) => {
                    return Err(ColumnError::Deposed { position })
                }
                Err(_) => self.rebuild_unit_by_rows(slot, position).await?,
            };
            let req = Request::WriteChecked {
                component: new.component,
                generation: self.generation,
                offset: slot * UNIT_BYTES,
                seq: 0,
                crcs: unit.chunks(BLOCK_BYTES).map(crc32c::crc32c).collect(),
            };
            peer.call(&req, Bytes::from(unit), self.timeout)
                .await
                .map_err(|e| column_error(position, e))?;
            copied.fetch_add(UNIT_BYTES, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(peer)
    }

    /// Puts `target` in place of column `position`, in service through
    /// `peer`: its rebuild is committed.
    pub fn replace(&self, position: usize, target: ColumnTarget, peer: Peer) {
        let mut targets = self.targets.write().unwrap_or_else(|e| e.into_inner());
        let mut peers = self.peers.write().unwrap_or_else(|e| e.into_inner());
        if let (Some(t), Some(p)) = (targets.get_mut(position), peers.get_mut(position)) {
            *t = target;
            *p = Some(Arc::new(peer));
        }
    }

    /// Column `lost`'s unit of stripe slot `slot`, from whole units of
    /// `k` columns in service.
    async fn rebuild_unit(&self, slot: u64, lost: usize) -> Result<Vec<u8>, ColumnError> {
        let others: Vec<usize> = self
            .in_service()
            .into_iter()
            .filter(|p| *p != lost)
            .take(self.columns.data_units())
            .collect();
        let reads = others
            .iter()
            .map(|&p| self.read_at(p, slot * UNIT_BYTES, UNIT_BYTES as u32));
        let mut units: Vec<Option<Vec<u8>>> = vec![None; self.columns.width()];
        for (&p, r) in others.iter().zip(join_all(reads).await) {
            units[p] = Some(r?.to_vec());
        }
        let have = units.iter().flatten().count();
        if have < self.columns.data_units() {
            let need = self.columns.data_units();
            return Err(ColumnError::TooFewColumns { have, need });
        }
        let mut whole = self.columns.rebuild_row(&self.codec, slot, units)?;
        Ok(std::mem::take(&mut whole[lost]))
    }

    /// `rebuild_unit` one row at a time, each from whichever `k` columns
    /// read it (a bad block in one column is read around).
    async fn rebuild_unit_by_rows(&self, slot: u64, lost: usize) -> Result<Vec<u8>, ColumnError> {
        let mut unit = Vec::with_capacity(UNIT_BYTES as usize);
        for row in 0..UNIT_BYTES / BLOCK_BYTES as u64 {
            let offset = slot * UNIT_BYTES + row * BLOCK_BYTES as u64;
            let data = self.rebuild(slot, lost, offset, &mut Vec::new()).await?;
            unit.extend_from_slice(&data);
        }
        Ok(unit)
    }

    fn peer(&self, position: usize) -> Result<Arc<Peer>, ColumnError> {
        let peers = self.peers.read().unwrap_or_else(|e| e.into_inner());
        peers
            .get(position)
            .and_then(|p| p.clone())
            .ok_or(ColumnError::Column {
                position,
                error: RpcError::Closed,
            })
    }
}

/// Whether a column's error is one block failing its checksum.
fn is_bad_block(e: &ColumnError) -> bool {
    matches!(
        e,
        ColumnError::Column {
            error: RpcError::Remote(RemoteError::Checksum { .. }),
            ..
        }
    )
}

/// A column's error, a newer owner's refusal told apart.
fn column_error(position: usize, error: RpcError) -> ColumnError {
    match error {
        RpcError::Remote(RemoteError::StaleGeneration { .. }) => ColumnError::Deposed { position },
        error => ColumnError::Column { position, error },
    }
}

async fn activate_one(
    t: &ColumnTarget,
    (volume, size, create): (VolumeId, u64, bool),
    generation: Generation,
    timeout: Duration,
    auth: &PeerAuth,
) -> Result<Peer, RpcError> {
    let peer = Peer::connect(&t.addr, timeout, auth).await?;
    if create {
        let req = Request::CreateComponent {
            component: t.component,
            volume,
            device: t.device,
            size,
        };
        peer.call(&req, Bytes::new(), timeout).await?;
    }
    let req = Request::Activate {
        component: t.component,
        generation,
    };
    peer.call(&req, Bytes::new(), timeout).await?;
    if !create {
        // An owner before this one may have committed a growth while
        // this column was out of service.
        grow_one(&peer, t.component, size, timeout).await?;
    }
    Ok(peer)
}

/// Grows `component` to at least `size` bytes (never shrinks it).
async fn grow_one(
    peer: &Peer,
    component: ComponentId,
    size: u64,
    timeout: Duration,
) -> Result<(), RpcError> {
    let req = Request::ResizeComponent { component, size };
    peer.call(&req, Bytes::new(), timeout).await.map(|_| ())
}
