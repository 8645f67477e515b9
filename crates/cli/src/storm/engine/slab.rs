//! Requests and attempts by key: a slab whose keys carry a generation, packed into an event's
//! payload.

/// A slab with generations, so an event naming a freed and reused slot is recognised as stale.
#[derive(Debug)]
pub(super) struct Slab<T> {
    items: Vec<(u32, Option<T>)>,
    free: Vec<u32>,
}

/// Generations are kept to 24 bits (they share an event's payload with its kind and index).
const GEN_MASK: u32 = (1 << 24) - 1;

impl<T> Slab<T> {
    pub(super) fn new() -> Self {
        Self {
            items: Vec::new(),
            free: Vec::new(),
        }
    }

    pub(super) fn insert(&mut self, value: T) -> Key {
        match self.free.pop() {
            Some(idx) => {
                let slot = &mut self.items[idx as usize];
                slot.0 = (slot.0 + 1) & GEN_MASK;
                slot.1 = Some(value);
                Key {
                    idx,
                    generation: slot.0,
                }
            }
            None => {
                let idx = u32::try_from(self.items.len()).expect("fewer than 2^32 live entries");
                self.items.push((0, Some(value)));
                Key { idx, generation: 0 }
            }
        }
    }

    pub(super) fn get(&mut self, key: Key) -> Option<&mut T> {
        match self.items.get_mut(key.idx as usize) {
            Some((generation, Some(value))) if *generation == key.generation => Some(value),
            _ => None,
        }
    }

    pub(super) fn remove(&mut self, key: Key) -> Option<T> {
        match self.items.get_mut(key.idx as usize) {
            Some((generation, value)) if *generation == key.generation && value.is_some() => {
                self.free.push(key.idx);
                value.take()
            }
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Key {
    idx: u32,
    generation: u32,
}

impl Key {
    pub(super) fn pack(self) -> u64 {
        (u64::from(self.generation) << 32) | u64::from(self.idx)
    }

    pub(super) fn unpack(v: u64) -> Self {
        Key {
            idx: v as u32,
            generation: ((v >> 32) as u32) & GEN_MASK,
        }
    }
}
