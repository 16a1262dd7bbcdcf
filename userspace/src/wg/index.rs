//! The device's session indices: every session and every handshake in flight gets a
//! 32-bit index drawn at random, unique in the device, and a message names the session it
//! is for by that index. The table says which peer holds an index; a tunnel takes one
//! when it sends an initiation or has verified one, and gives it back when the session
//! or the attempt is gone.

use std::collections::HashMap;
use std::sync::RwLock;

/// A peer, by its public key.
pub type Owner = [u8; 32];

/// Draws before `claim` gives up (the table is never near full: 2^32 indices).
const DRAWS: usize = 16;

#[derive(Default)]
pub struct Indices {
    map: RwLock<HashMap<u32, Owner>>,
}

impl Indices {
    /// A fresh index for `owner`: random, non-zero, held by nobody. None when the kernel
    /// gives no randomness (a guessable index would let a stranger name a session).
    pub fn claim(&self, owner: Owner) -> Option<u32> {
        let mut map = self.map.write().unwrap_or_else(|p| p.into_inner());
        for _ in 0..DRAWS {
            let index = u32::from_le_bytes(weft_crypto::random_bytes::<4>().ok()?);
            if index != 0 && !map.contains_key(&index) {
                map.insert(index, owner);
                return Some(index);
            }
        }
        None
    }

    /// Gives `index` back, if `owner` holds it.
    pub fn release(&self, index: u32, owner: &Owner) {
        let mut map = self.map.write().unwrap_or_else(|p| p.into_inner());
        if map.get(&index) == Some(owner) {
            map.remove(&index);
        }
    }

    /// The peer holding `index`.
    pub fn owner(&self, index: u32) -> Option<Owner> {
        self.map
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&index)
            .copied()
    }

    /// How many indices are held.
    pub fn len(&self) -> usize {
        self.map.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_are_random_unique_and_released_only_by_their_owner() {
        let t = Indices::default();
        let got: Vec<u32> = (0..2000).map(|_| t.claim([1; 32]).unwrap()).collect();
        let unique: std::collections::HashSet<_> = got.iter().collect();
        assert_eq!(unique.len(), got.len());
        // Every bit takes both values: no byte is a counter or fixed.
        for bit in 0..32 {
            let ones = got.iter().filter(|i| *i & (1 << bit) != 0).count();
            assert!((800..1200).contains(&ones), "bit {bit}: {ones} of 2000 set");
        }
        t.release(got[0], &[2; 32]);
        assert_eq!(
            t.owner(got[0]),
            Some([1; 32]),
            "another peer cannot free it"
        );
        t.release(got[0], &[1; 32]);
        assert_eq!(t.owner(got[0]), None);
        assert_eq!(t.len(), 1999);
    }
}
