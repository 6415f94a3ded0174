//! Every volume of the cluster as an NBD export of this node, by name. An
//! encrypted volume's data is encrypted here, before it leaves for the
//! owner, and decrypted here (see [`crate::encryption`]).

use crate::router::{Counters, IoFailure, Router};
use bytes::Bytes;
use futures::future::{ready, Either};
use futures::FutureExt;
use shoal_crypt::SectorCipher;
use shoal_model::VolumeId;
use shoal_nbd::{Export, Exports, IoError};
use shoal_rpc::VolumeOp;
use std::future::Future;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

pub struct VolumeExports {
    pub router: Arc<Router>,
}

/// One client connection's handle on a volume; counted while open.
pub struct VolumeExport {
    router: Arc<Router>,
    volume: VolumeId,
    name: String,
    size: u64,
    /// The volume's cipher when it is encrypted.
    cipher: Option<Arc<SectorCipher>>,
}

impl Drop for VolumeExport {
    fn drop(&mut self) {
        if let Ok(mut m) = self.router.connections.lock() {
            if let Some(n) = m.get_mut(&self.name) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    m.remove(&self.name);
                }
            }
        }
    }
}

fn nbd_err(e: IoFailure) -> IoError {
    match e {
        IoFailure::OutOfRange => IoError::Invalid,
        IoFailure::NoSpace => IoError::NoSpace,
        IoFailure::Gone => IoError::Shutdown,
        IoFailure::Io(msg) => {
            tracing::warn!("I/O failed: {msg}");
            IoError::Io
        }
    }
}

impl VolumeExport {
    /// Starts `op` now (a local owner takes it at this call); the future
    /// answers it and adds its time to `micros`.
    fn run(
        &self,
        op: VolumeOp,
        payload: Bytes,
        micros: Option<fn(&Counters) -> &AtomicU64>,
    ) -> impl Future<Output = Result<Bytes, IoError>> + Send + 'static {
        let started = Instant::now();
        let io = self.router.start_io(self.volume, op, payload);
        let router = self.router.clone();
        // A combinator, not an `async` block: an `async` wrapper keeps the
        // inner future twice in its state, and this one sits on every
        // request's path.
        io.map(move |r| {
            if let Some(f) = micros {
                f(&router.counters).fetch_add(started.elapsed().as_micros() as u64, Relaxed);
            }
            r.map_err(nbd_err)
        })
    }
}

/// `data` of an encrypted volume at `offset`, as the client sees it.
fn decrypted(c: &SectorCipher, offset: u64, data: Bytes) -> Result<Bytes, IoError> {
    let mut out = Vec::with_capacity(data.len());
    c.decrypt_into(offset, &data, &mut out)
        .map_err(|_| IoError::Invalid)?;
    Ok(Bytes::from(out))
}

impl VolumeExport {
    /// Whether `(offset, len)` may go to the volume: an encrypted volume
    /// takes whole sectors only (it advertises them as its minimum block).
    fn takes(&self, offset: u64, len: u64) -> bool {
        self.cipher.is_none() || crate::encryption::aligned(offset, len)
    }
}

impl Export for VolumeExport {
    fn size(&self) -> u64 {
        self.size
    }

    fn min_block_size(&self) -> u32 {
        match self.cipher {
            Some(_) => crate::encryption::ENCRYPTED_MIN_BLOCK_BYTES,
            None => shoal_nbd::MIN_BLOCK_SIZE,
        }
    }

    /// Every write is durable on its replicas before it is acknowledged, so
    /// a FLUSH on any connection covers the writes of all of them.
    fn multi_conn(&self) -> bool {
        true
    }

    fn read(
        &self,
        offset: u64,
        len: u32,
    ) -> impl Future<Output = Result<Bytes, IoError>> + Send + 'static {
        let c = &self.router.counters;
        c.reads.fetch_add(1, Relaxed);
        c.read_bytes.fetch_add(len as u64, Relaxed);
        if !self.takes(offset, len as u64) {
            return Either::Left(ready(Err(IoError::Invalid)));
        }
        let cipher = self.cipher.clone();
        let read = self.run(
            VolumeOp::Read { offset, len },
            Bytes::new(),
            Some(|c| &c.read_micros),
        );
        Either::Right(read.map(move |r| match (r, cipher) {
            (Ok(data), Some(c)) => decrypted(&c, offset, data),
            (r, _) => r,
        }))
    }

    fn write(
        &self,
        offset: u64,
        data: Bytes,
        fua: bool,
    ) -> impl Future<Output = Result<(), IoError>> + Send + 'static {
        let c = &self.router.counters;
        c.writes.fetch_add(1, Relaxed);
        c.write_bytes.fetch_add(data.len() as u64, Relaxed);
        if !self.takes(offset, data.len() as u64) {
            return Either::Left(ready(Err(IoError::Invalid)));
        }
        let data = match &self.cipher {
            None => data,
            Some(c) => {
                let mut out = Vec::with_capacity(data.len());
                if c.encrypt_into(offset, &data, &mut out).is_err() {
                    return Either::Left(ready(Err(IoError::Invalid)));
                }
                Bytes::from(out)
            }
        };
        let write = self.run(
            VolumeOp::Write { offset, fua },
            data,
            Some(|c| &c.write_micros),
        );
        Either::Right(write.map(|r| r.map(|_| ())))
    }

    fn flush(&self) -> impl Future<Output = Result<(), IoError>> + Send + 'static {
        self.run(VolumeOp::Flush, Bytes::new(), None)
            .map(|r| r.map(|_| ()))
    }

    fn trim(
        &self,
        offset: u64,
        len: u32,
        _fua: bool,
    ) -> impl Future<Output = Result<(), IoError>> + Send + 'static {
        // A trimmed sector reads as zeros, encrypted volume or not (a
        // sector of zero ciphertext is a hole).
        if !self.takes(offset, len as u64) {
            return Either::Left(ready(Err(IoError::Invalid)));
        }
        Either::Right(
            self.run(VolumeOp::Trim { offset, len }, Bytes::new(), None)
                .map(|r| r.map(|_| ())),
        )
    }

    fn write_zeroes(
        &self,
        offset: u64,
        len: u32,
        _fua: bool,
        _may_trim: bool,
    ) -> impl Future<Output = Result<(), IoError>> + Send + 'static {
        if !self.takes(offset, len as u64) {
            return Either::Left(ready(Err(IoError::Invalid)));
        }
        Either::Right(
            self.run(VolumeOp::WriteZeroes { offset, len }, Bytes::new(), None)
                .map(|r| r.map(|_| ())),
        )
    }

    fn request_started(&self) {
        self.router.client_requests.fetch_add(1, Relaxed);
    }

    fn request_ended(&self) {
        self.router.client_requests.fetch_sub(1, Relaxed);
    }
}

impl Exports for VolumeExports {
    type Export = VolumeExport;

    async fn list(&self) -> Vec<String> {
        self.router
            .dir
            .state()
            .volumes
            .values()
            .map(|v| v.name.clone())
            .collect()
    }

    async fn open(&self, name: &str) -> Result<VolumeExport, String> {
        let state = self.router.state_knowing(name).await;
        let Some(v) = state.volume_by_name(name) else {
            tracing::info!(name, "NBD client asked for an export that is no volume");
            // The other volumes' names are not the asker's business.
            return Err(format!("no volume named {name:?}"));
        };
        let cipher = match &v.wrapped_key {
            None => None,
            Some(w) => Some(crate::encryption::cipher(
                self.router.cluster_key.as_deref(),
                name,
                w,
            )?),
        };
        if let Ok(mut m) = self.router.connections.lock() {
            *m.entry(name.to_string()).or_default() += 1;
        }
        Ok(VolumeExport {
            router: self.router.clone(),
            volume: v.id,
            name: name.to_string(),
            size: v.size,
            cipher,
        })
    }
}
