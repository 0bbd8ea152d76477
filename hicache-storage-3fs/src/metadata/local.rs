//! Page metadata held in this process (one host, one process per file set): the reference the Redis scripts are
//! tested against.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;

use hicache_core::Error;

use super::{Located, PageMetadata, Reservation, Space, SpaceCounts, mismatch};

/// Page metadata in this process.
#[derive(Default)]
pub struct LocalMetadata {
    spaces: Mutex<HashMap<String, SpaceState>>,
}

#[derive(Default)]
struct SpaceState {
    num_pages: u64,
    page_bytes: u64,
    /// Pages `fresh..num_pages` were never handed out.
    fresh: u64,
    /// Freed pages, taken oldest first.
    free: VecDeque<u64>,
    generations: HashMap<u64, u64>,
    /// key → (page, LRU tick)
    keys: HashMap<String, (Located, u64)>,
    /// LRU tick → key
    lru: BTreeMap<u64, String>,
    /// page → generation of its open reservation
    reserved: HashMap<u64, u64>,
    tick: u64,
}

impl SpaceState {
    fn touch(&mut self, key: &str) {
        self.tick += 1;
        let tick = self.tick;
        if let Some((_, at)) = self.keys.get_mut(key) {
            self.lru.remove(at);
            *at = tick;
            self.lru.insert(tick, key.to_owned());
        }
    }

    fn publish(&mut self, key: &str, page: Located) {
        self.tick += 1;
        self.keys.insert(key.to_owned(), (page, self.tick));
        self.lru.insert(self.tick, key.to_owned());
    }

    fn forget(&mut self, key: &str) -> Option<Located> {
        let (page, tick) = self.keys.remove(key)?;
        self.lru.remove(&tick);
        Some(page)
    }

    fn take_page(&mut self) -> Option<u64> {
        if let Some(index) = self.free.pop_front() {
            return Some(index);
        }
        if self.fresh < self.num_pages {
            self.fresh += 1;
            return Some(self.fresh - 1);
        }
        let (_, victim) = self.lru.pop_first()?;
        self.keys.remove(&victim).map(|(page, _)| page.index)
    }
}

impl LocalMetadata {
    /// Empty metadata.
    pub fn new() -> Self {
        Self::default()
    }

    fn with_space<R>(&self, space: &Space, f: impl FnOnce(&mut SpaceState) -> R) -> Result<R, Error> {
        let mut spaces = self.spaces.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let state = spaces.entry(space.id.clone()).or_insert_with(|| SpaceState {
            num_pages: space.num_pages,
            page_bytes: space.page_bytes,
            ..SpaceState::default()
        });
        if (state.num_pages, state.page_bytes) != (space.num_pages, space.page_bytes) {
            return Err(mismatch(space, state.num_pages, state.page_bytes));
        }
        Ok(f(state))
    }
}

impl PageMetadata for LocalMetadata {
    fn describe(&self) -> String {
        "in-process".into()
    }

    fn reserve(&self, space: &Space, keys: &[String]) -> Result<Vec<Reservation>, Error> {
        self.with_space(space, |state| {
            keys.iter()
                .map(|key| {
                    if state.keys.contains_key(key) {
                        state.touch(key);
                        return Reservation::Present;
                    }
                    match state.take_page() {
                        Some(index) => {
                            let generation = state.generations.entry(index).or_insert(0);
                            *generation += 1;
                            let generation = *generation;
                            state.reserved.insert(index, generation);
                            Reservation::Page(Located { index, generation })
                        }
                        None => Reservation::Full,
                    }
                })
                .collect()
        })
    }

    fn confirm(&self, space: &Space, written: &[(String, Located)], released: &[Located]) -> Result<(), Error> {
        self.with_space(space, |state| {
            for (key, page) in written {
                if state.reserved.get(&page.index) != Some(&page.generation) {
                    continue;
                }
                state.reserved.remove(&page.index);
                if state.keys.contains_key(key) {
                    state.free.push_back(page.index);
                } else {
                    state.publish(key, *page);
                }
            }
            for page in released {
                if state.reserved.get(&page.index) == Some(&page.generation) {
                    state.reserved.remove(&page.index);
                    state.free.push_back(page.index);
                }
            }
        })
    }

    fn locate(&self, space: &Space, keys: &[String]) -> Result<Vec<Option<Located>>, Error> {
        self.with_space(space, |state| {
            keys.iter()
                .map(|key| {
                    let page = state.keys.get(key).map(|(page, _)| *page)?;
                    state.touch(key);
                    Some(page)
                })
                .collect()
        })
    }

    fn exists(&self, space: &Space, keys: &[String]) -> Result<Vec<bool>, Error> {
        self.with_space(space, |state| keys.iter().map(|key| state.keys.contains_key(key)).collect())
    }

    fn delete(&self, space: &Space, keys: &[String]) -> Result<usize, Error> {
        self.with_space(space, |state| {
            let mut count = 0;
            for key in keys {
                if let Some(page) = state.forget(key) {
                    state.free.push_back(page.index);
                    count += 1;
                }
            }
            count
        })
    }

    fn clear(&self, space: &Space, prefix: &str) -> Result<u64, Error> {
        self.with_space(space, |state| {
            let keys: Vec<String> = state.keys.keys().filter(|key| key.starts_with(prefix)).cloned().collect();
            for key in &keys {
                if let Some(page) = state.forget(key) {
                    state.free.push_back(page.index);
                }
            }
            keys.len() as u64
        })
    }

    fn list(&self, space: &Space, prefix: &str) -> Result<Vec<String>, Error> {
        self.with_space(space, |state| state.keys.keys().filter(|key| key.starts_with(prefix)).cloned().collect())
    }

    fn counts(&self, space: &Space) -> Result<SpaceCounts, Error> {
        self.with_space(space, |state| SpaceCounts {
            stored: state.keys.len() as u64,
            reserved: state.reserved.len() as u64,
        })
    }

    fn round_trips(&self) -> u64 {
        0
    }
}
