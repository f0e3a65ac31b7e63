//! `Scheduler::check_integrity`: verifies every cross-structure invariant listed in
//! `scheduler.rs` and `block_pool.rs`. O(total blocks + sequences); for tests and debugging.

use crate::block_pool::NULL_BLOCK;
use crate::config::Policy;
use crate::error::IntegrityError;
use crate::request::SeqStatus;
use crate::scheduler::Scheduler;
use std::collections::{HashMap, HashSet};

impl Scheduler {
    /// Checks that blocks, ref counts, queues and request groups agree; describes the first
    /// broken invariant.
    pub fn check_integrity(&self) -> Result<(), IntegrityError> {
        let err = |m: String| Err(IntegrityError(m));
        self.pool.check_integrity()?;
        let bs = self.cfg.block_size;
        let mut refs = vec![0u32; self.pool.num_blocks()];
        let mut live = 0usize;
        // handle -> tokens (new + draft) it computes this step, while a step is out
        let scheduled: HashMap<u32, usize> = if self.awaiting_update {
            self.scheduled
                .iter()
                .map(|x| (x.handle, x.num_new + x.num_draft))
                .collect()
        } else {
            HashMap::new()
        };
        for (h, s) in self.seqs.iter().enumerate() {
            let Some(s) = s else { continue };
            let h = h as u32;
            live += 1;
            let mut own = HashSet::new();
            for &b in &s.blocks {
                if b == NULL_BLOCK || b as usize >= refs.len() {
                    return err(format!("sequence {h} holds invalid block {b}"));
                }
                if !own.insert(b) {
                    return err(format!("sequence {h} holds block {b} twice"));
                }
                refs[b as usize] += 1;
            }
            if s.req.prompt_len == 0 || s.req.prompt_len > s.tokens.len() {
                return err(format!("sequence {h} has a bad prompt length"));
            }
            if s.num_computed_tokens > s.tokens.len() {
                return err(format!("sequence {h} computed more tokens than it has"));
            }
            if s.block_hashes.len() > s.tokens.len() / bs {
                return err(format!("sequence {h} hashed a partial block"));
            }
            match s.status {
                SeqStatus::Waiting => {
                    if !s.blocks.is_empty() || s.num_computed_tokens != 0 {
                        return err(format!(
                            "waiting sequence {h} holds blocks or computed tokens"
                        ));
                    }
                    if !self.waiting.contains(&s.key(h)) {
                        return err(format!("waiting sequence {h} is not in the waiting set"));
                    }
                }
                SeqStatus::Running => {
                    if !self.running.contains(&h) {
                        return err(format!("running sequence {h} is not in the running list"));
                    }
                    if let Some(&step) = scheduled.get(&h) {
                        let w = (s.num_computed_tokens + step).div_ceil(bs);
                        if s.blocks.len() != w {
                            return err(format!(
                                "scheduled sequence {h} holds {} blocks, expected {w}",
                                s.blocks.len()
                            ));
                        }
                    } else {
                        let w = s.num_computed_tokens.div_ceil(bs);
                        if s.blocks.len() != w {
                            return err(format!(
                                "running sequence {h} holds {} blocks, expected {w}",
                                s.blocks.len()
                            ));
                        }
                        if s.num_computed_tokens >= s.tokens.len() {
                            return err(format!(
                                "running sequence {h} has nothing left to compute"
                            ));
                        }
                    }
                }
            }
            match self.groups.get(&s.req.request_id) {
                Some(g) if g.seqs.contains(&h) => {}
                _ => return err(format!("sequence {h} is missing from its request group")),
            }
            if !s.unforked.is_empty() && s.output_len() != 0 {
                return err(format!("sequence {h} has unforked children after sampling"));
            }
        }
        for b in 1..refs.len() as u32 {
            if self.pool.refcount(b) != refs[b as usize] {
                return err(format!(
                    "block {b} has refcount {} but {} block tables hold it",
                    self.pool.refcount(b),
                    refs[b as usize]
                ));
            }
        }
        if self.waiting.len() + self.running.len() != live {
            return err(format!(
                "{} waiting + {} running != {live} live sequences",
                self.waiting.len(),
                self.running.len()
            ));
        }
        let uniq: HashSet<u32> = self.running.iter().copied().collect();
        if uniq.len() != self.running.len() {
            return err("a sequence is in the running list twice".into());
        }
        for &h in &self.running {
            if self
                .seqs
                .get(h as usize)
                .and_then(|s| s.as_ref())
                .is_none_or(|s| s.status != SeqStatus::Running)
            {
                return err(format!("running list holds dead or waiting handle {h}"));
            }
        }
        if self.running.len() > self.cfg.max_num_seqs {
            return err("more running sequences than max_num_seqs".into());
        }
        if self.cfg.policy == Policy::Fcfs {
            let key = |h: u32| self.seqs[h as usize].as_ref().map(|s| s.key(h));
            if self.running.windows(2).any(|w| key(w[0]) > key(w[1])) {
                return err("FCFS running list is not in key order".into());
            }
        }
        let in_groups: usize = self.groups.values().map(|g| g.seqs.len()).sum();
        if in_groups != live || self.groups.values().any(|g| g.seqs.is_empty()) {
            return err("request groups disagree with the live sequences".into());
        }
        let live_ids = self.intake.live_ids();
        if let Some(id) = self.groups.keys().find(|id| !live_ids.contains(id)) {
            return err(format!("request {id} is live but its id was retired"));
        }
        Ok(())
    }
}
