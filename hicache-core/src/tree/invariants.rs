//! The tree's invariants (docs/sglang.md#invariants), checked in full: for tests, and for replays that want to be sure.

use std::collections::HashSet;

use super::HiRadixTree;
use crate::error::Error;
use crate::host_pool::PageState;
use crate::transfer::TransferEngine;

impl<E: TransferEngine> HiRadixTree<E> {
    /// Checks every invariant of the tree against itself and the controller's allocator.
    ///
    /// * Keys are whole pages; children are keyed by their first page and point back to their parent.
    /// * Trailing-window flags: one per page with a trailing window, none without.
    /// * Device slots: one per token, never shared; host pages and page keys: one per page, never shared; host pages
    ///   are allocated in the host pool.
    /// * Device residency is prefix-closed; an evicted node is backed up.
    /// * A parent is locked at least as often as each child; the evictable and protected counts add up.
    ///
    /// # Errors
    ///
    /// [`Error::Internal`] naming the first violation.
    pub fn check_invariants(&self) -> Result<(), Error> {
        let fail = |message: String| Err(Error::Internal(format!("tree invariant: {message}")));
        let page = self.page_size;
        let mut slots = HashSet::new();
        let mut pages = HashSet::new();
        let (mut evictable, mut protected) = (0, 0);
        for (&id, node) in &self.nodes {
            for (first, &child) in &node.children {
                let Some(entry) = self.nodes.get(&child) else { return fail(format!("{id:?} has a dead child")) };
                if entry.parent != Some(id) || entry.key.len() < page || entry.key[..page] != **first {
                    return fail(format!("{child:?} is not the child {id:?} keys it as"));
                }
                if entry.lock_ref > node.lock_ref && id != self.root {
                    return fail(format!("{child:?} is locked more than its parent {id:?}"));
                }
                if !entry.evicted() && node.evicted() {
                    return fail(format!("{child:?} is on the device below evicted {id:?}"));
                }
            }
            if id == self.root {
                continue;
            }
            let parent = node.parent.and_then(|parent| self.nodes.get(&parent));
            if parent.is_none_or(|parent| !parent.children.values().any(|child| *child == id)) {
                return fail(format!("{id:?} is not its parent's child"));
            }
            if node.key.is_empty() || node.key.len() % page != 0 {
                return fail(format!("{id:?} has {} tokens, not whole pages", node.key.len()));
            }
            let node_pages = node.key.len() / page;
            match &node.device {
                Some(device) => {
                    if device.len() != node.key.len() {
                        return fail(format!("{id:?}: {} slots for {} tokens", device.len(), node.key.len()));
                    }
                    if let Some(slot) = device.iter().find(|slot| !slots.insert(**slot)) {
                        return fail(format!("device slot {slot} is held twice"));
                    }
                    if node.lock_ref > 0 {
                        protected += device.len();
                    } else {
                        evictable += device.len();
                    }
                }
                None if node.host.is_none() => return fail(format!("{id:?} is neither on the device nor the host")),
                None => {}
            }
            if let Some(host) = &node.host {
                if host.len() != node_pages {
                    return fail(format!("{id:?}: {} host pages for {node_pages} pages", host.len()));
                }
                for &host_page in host {
                    if !pages.insert(host_page) {
                        return fail(format!("{host_page} is held twice"));
                    }
                    if self.controller.host().state(host_page)? == PageState::Idle {
                        return fail(format!("{id:?} holds free {host_page}"));
                    }
                }
            }
            let trailing_pages = if self.settings.trailing_window.is_some() { node_pages } else { 0 };
            if node.trailing.len() != trailing_pages {
                return fail(format!("{id:?}: {} trailing flags for {node_pages} pages", node.trailing.len()));
            }
            if self.controller.has_storage() && node.hashes.len() != node_pages {
                return fail(format!("{id:?}: {} page keys for {node_pages} pages", node.hashes.len()));
            }
        }
        if (evictable, protected) != (self.evictable_tokens, self.protected_tokens) {
            return fail(format!(
                "counted {evictable} evictable and {protected} protected tokens, the tree says {} and {}",
                self.evictable_tokens, self.protected_tokens
            ));
        }
        Ok(())
    }
}
