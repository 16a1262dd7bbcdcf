//! One lab at a time per test binary. The test harness runs a binary's tests on as many
//! threads as there are cores; two labs at once on this 2-core machine halve each other's
//! CPU and make every bound in them a bound on the neighbour's load. A lab holds its turn
//! from its first namespace to its drop.

use std::sync::{Condvar, Mutex};

static BUSY: Mutex<bool> = Mutex::new(false);
static FREED: Condvar = Condvar::new();

/// The right to run a lab; released on drop.
pub struct Turn(());

impl Turn {
    /// Waits until no other lab of this process runs.
    pub fn take() -> Turn {
        // A test that panicked while holding the lock leaves it poisoned; the flag it
        // guards is still right (the panicking lab's drop released its turn).
        let mut busy = BUSY.lock().unwrap_or_else(|e| e.into_inner());
        while *busy {
            busy = FREED.wait(busy).unwrap_or_else(|e| e.into_inner());
        }
        *busy = true;
        Turn(())
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        *BUSY.lock().unwrap_or_else(|e| e.into_inner()) = false;
        FREED.notify_one();
    }
}
