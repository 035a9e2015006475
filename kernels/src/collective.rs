//! Sums across the ranks of a tensor-parallel group: the all-reduce after each
//! row-parallel projection. `ThreadGroup` is the in-process one for the CPU backend
//! (one thread per rank), so that tensor parallelism is checked without GPUs; GPUs use
//! NCCL.

use crate::cpu::CpuBackend;
use crate::{Backend, KernelError, Result};
use std::sync::{Arc, Condvar, Mutex};

/// One rank's handle on its group.
pub trait AllReduce<B: Backend>: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Replaces `x` on every rank with the sum of all ranks' `x`. Every rank must call
    /// it, in the same order, with buffers of the same length.
    fn all_reduce_sum(&self, backend: &B, x: &mut B::Buffer) -> Result<()>;
    /// Wakes every rank waiting in `all_reduce_sum` with an error: a rank that failed
    /// calls it so that the others do not wait for it forever.
    fn abort(&self);
}

/// Ranks that are threads of one process.
pub struct ThreadGroup {
    size: usize,
    state: Mutex<Round>,
    changed: Condvar,
}

#[derive(Default)]
struct Round {
    /// Counts finished rounds, so a fast rank cannot join the next one early.
    generation: u64,
    parts: Vec<Option<Vec<f32>>>,
    arrived: usize,
    sum: Option<Arc<Vec<f32>>>,
    taken: usize,
    aborted: bool,
}

pub struct ThreadRank {
    group: Arc<ThreadGroup>,
    rank: usize,
}

impl ThreadGroup {
    /// A group of `size` ranks: one handle per rank, in rank order.
    pub fn ranks(size: usize) -> Vec<ThreadRank> {
        let group = Arc::new(ThreadGroup {
            size,
            state: Mutex::new(Round { parts: vec![None; size], ..Round::default() }),
            changed: Condvar::new(),
        });
        (0..size).map(|rank| ThreadRank { group: group.clone(), rank }).collect()
    }
}

fn aborted() -> KernelError {
    KernelError::Device { op: "all_reduce", detail: "another rank of the group failed".into() }
}

impl AllReduce<CpuBackend> for ThreadRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.group.size
    }

    fn all_reduce_sum(&self, _backend: &CpuBackend, x: &mut Vec<f32>) -> Result<()> {
        let g = &self.group;
        let mut s = g.state.lock().map_err(|_| aborted())?;
        // Wait until the previous round has been handed out to every rank.
        while s.sum.is_some() && !s.aborted {
            s = g.changed.wait(s).map_err(|_| aborted())?;
        }
        if s.aborted {
            return Err(aborted());
        }
        let generation = s.generation;
        s.parts[self.rank] = Some(std::mem::take(x));
        s.arrived += 1;
        if s.arrived == g.size {
            // Summed in rank order, so every run adds in the same order.
            let mut parts = s.parts.iter_mut().map(|p| p.take().expect("every rank arrived"));
            let mut sum = parts.next().expect("a group has a rank");
            for p in parts {
                if p.len() != sum.len() {
                    s.aborted = true;
                    g.changed.notify_all();
                    return Err(KernelError::shape("all_reduce", "ranks gave buffers of different lengths"));
                }
                sum.iter_mut().zip(&p).for_each(|(a, b)| *a += b);
            }
            s.sum = Some(Arc::new(sum));
            g.changed.notify_all();
        }
        while (s.sum.is_none() || s.generation != generation) && !s.aborted {
            s = g.changed.wait(s).map_err(|_| aborted())?;
        }
        if s.aborted {
            return Err(aborted());
        }
        *x = s.sum.as_ref().expect("the round is summed").as_ref().clone();
        s.taken += 1;
        if s.taken == g.size {
            s.sum = None;
            s.arrived = 0;
            s.taken = 0;
            s.generation += 1;
            g.changed.notify_all();
        }
        Ok(())
    }

    fn abort(&self) {
        if let Ok(mut s) = self.group.state.lock() {
            s.aborted = true;
        }
        self.group.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_gets_the_sum_round_after_round() {
        let ranks = ThreadGroup::ranks(3);
        let results: Vec<Vec<Vec<f32>>> = std::thread::scope(|scope| {
            let handles: Vec<_> = ranks
                .iter()
                .map(|r| {
                    scope.spawn(move || {
                        (0..50)
                            .map(|round| {
                                let mut x = vec![r.rank() as f32 + round as f32, 1.0];
                                r.all_reduce_sum(&CpuBackend::default(), &mut x).unwrap();
                                x
                            })
                            .collect()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, rounds) in results.iter().enumerate() {
            for (round, x) in rounds.iter().enumerate() {
                assert_eq!(x, &vec![3.0 + 3.0 * round as f32, 3.0], "rank {rank} round {round}");
            }
        }
    }

    #[test]
    fn an_aborted_group_fails_the_waiting_ranks() {
        let ranks = ThreadGroup::ranks(2);
        std::thread::scope(|scope| {
            let waiting = scope.spawn(|| ranks[0].all_reduce_sum(&CpuBackend::default(), &mut vec![1.0]));
            ranks[1].abort();
            assert!(waiting.join().unwrap().is_err());
        });
    }
}
