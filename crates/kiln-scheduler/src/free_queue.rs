//! The queue of free blocks in eviction order: an intrusive doubly linked list over
//! block indices, so that pushing, popping and removing any block are O(1).
//!
//! The front is evicted (reused) first. The block pool pushes freed blocks that hold
//! a cached hash at the back (most recently used) and blocks without one at the front
//! (they are worth nothing), and removes a free block from the middle when a prefix
//! hit takes it back.

/// The end-of-list marker.
const NIL: u32 = u32::MAX;

/// Free blocks in eviction order.
#[derive(Debug, Clone)]
pub(crate) struct FreeQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    linked: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl FreeQueue {
    /// A queue holding every index in `0..num_blocks`, lowest first.
    ///
    /// `num_blocks` must be below `u32::MAX`; the pool checks this.
    pub(crate) fn full(num_blocks: u32) -> Self {
        let mut queue = FreeQueue {
            prev: vec![NIL; num_blocks as usize],
            next: vec![NIL; num_blocks as usize],
            linked: vec![false; num_blocks as usize],
            head: NIL,
            tail: NIL,
            len: 0,
        };
        for idx in 0..num_blocks {
            queue.push_back(idx);
        }
        queue
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn contains(&self, idx: u32) -> bool {
        self.linked[idx as usize]
    }

    /// Appends `idx` at the back (evicted last). It must not be queued already.
    pub(crate) fn push_back(&mut self, idx: u32) {
        debug_assert!(
            !self.contains(idx),
            "block {idx} queued twice; this is a bug"
        );
        let i = idx as usize;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        match self.tail {
            NIL => self.head = idx,
            tail => self.next[tail as usize] = idx,
        }
        self.tail = idx;
        self.linked[i] = true;
        self.len += 1;
    }

    /// Prepends `idx` at the front (evicted first). It must not be queued already.
    pub(crate) fn push_front(&mut self, idx: u32) {
        debug_assert!(
            !self.contains(idx),
            "block {idx} queued twice; this is a bug"
        );
        let i = idx as usize;
        self.next[i] = self.head;
        self.prev[i] = NIL;
        match self.head {
            NIL => self.tail = idx,
            head => self.prev[head as usize] = idx,
        }
        self.head = idx;
        self.linked[i] = true;
        self.len += 1;
    }

    /// Takes the block at the front, or `None` when the queue is empty.
    pub(crate) fn pop_front(&mut self) -> Option<u32> {
        let head = self.head;
        if head == NIL {
            return None;
        }
        self.remove(head);
        Some(head)
    }

    /// Unlinks `idx`, which must be queued.
    pub(crate) fn remove(&mut self, idx: u32) {
        debug_assert!(
            self.contains(idx),
            "block {idx} is not queued; this is a bug"
        );
        let i = idx as usize;
        let (prev, next) = (self.prev[i], self.next[i]);
        match prev {
            NIL => self.head = next,
            p => self.next[p as usize] = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.prev[n as usize] = prev,
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.linked[i] = false;
        self.len -= 1;
    }

    /// The queued indices from front (evicted first) to back.
    pub(crate) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let mut cursor = self.head;
        std::iter::from_fn(move || {
            if cursor == NIL {
                return None;
            }
            let idx = cursor;
            cursor = self.next[idx as usize];
            Some(idx)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(queue: &FreeQueue) -> Vec<u32> {
        queue.iter().collect()
    }

    #[test]
    fn keeps_order_through_pushes_pops_and_removals() {
        let mut queue = FreeQueue::full(5);
        assert_eq!(order(&queue), [0, 1, 2, 3, 4]);
        assert_eq!(queue.pop_front(), Some(0));
        queue.remove(2);
        queue.remove(4);
        assert_eq!(order(&queue), [1, 3]);
        queue.push_back(4);
        queue.push_front(2);
        queue.push_back(0);
        assert_eq!(order(&queue), [2, 1, 3, 4, 0]);
        assert_eq!(queue.len(), 5);
        for expected in [2, 1, 3, 4, 0] {
            assert_eq!(queue.pop_front(), Some(expected));
        }
        assert_eq!(queue.pop_front(), None);
        assert_eq!(queue.len(), 0);
        queue.push_front(3);
        assert_eq!(order(&queue), [3]);
        assert!(queue.contains(3) && !queue.contains(0));
    }
}
