//! Connection slots per client address: one host (a stranger flooding a
//! port, a client with a bug) cannot take every connection a port allows,
//! so the others keep being served.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// Connections open per client address, up to a bound.
#[derive(Clone)]
pub struct PerAddress {
    max: usize,
    open: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

/// One connection's place; given back when dropped.
pub struct AddressSlot {
    per: PerAddress,
    addr: IpAddr,
}

impl PerAddress {
    /// At most `max` connections from one address at once.
    pub fn new(max: usize) -> PerAddress {
        assert!(
            max > 0,
            "a port must take at least one connection per address"
        );
        PerAddress {
            max,
            open: Arc::default(),
        }
    }

    /// A place for a connection from `addr`, or `None` when it has `max`.
    pub fn take(&self, addr: IpAddr) -> Option<AddressSlot> {
        let mut m = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry(addr).or_default();
        if *n >= self.max {
            return None;
        }
        *n += 1;
        Some(AddressSlot {
            per: self.clone(),
            addr,
        })
    }

    /// Connections open from `addr`.
    pub fn open(&self, addr: IpAddr) -> usize {
        let m = self.open.lock().unwrap_or_else(|e| e.into_inner());
        m.get(&addr).copied().unwrap_or(0)
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut m = self.per.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&self.addr) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.addr);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_address_takes_at_most_its_share_and_gives_it_back() {
        let p = PerAddress::new(2);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let s1 = p.take(a).unwrap();
        let _s2 = p.take(a).unwrap();
        assert!(p.take(a).is_none());
        let _s3 = p.take(b).expect("another address is served");
        drop(s1);
        assert_eq!(p.open(a), 1);
        assert!(p.take(a).is_some());
    }
}
