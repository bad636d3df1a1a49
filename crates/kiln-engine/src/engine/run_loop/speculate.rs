//! The loop's speculation: drafts proposed before a step is scheduled (a
//! request's prediction, n-gram lookup, the draft model, the MTP head's
//! guesses of the step before), and the MTP head run after a step.

use super::*;

impl<'m> Loop<'m> {
    /// Proposes draft tokens for the decodes of requests that speculate,
    /// unless more requests run than speculation pays for.
    pub(super) fn propose_drafts(&mut self) {
        let running = self.scheduler.num_running();
        if let Some(m) = self.mtp.as_mut() {
            let active = &self.active;
            m.retain(|id| active.contains_key(id));
        }
        if running == 0 || running > self.speculative.max_batch {
            return;
        }
        // Requests the draft model guesses for: id, context, length.
        let mut for_draft = Vec::new();
        for (id, a) in self.active.iter_mut() {
            if !a.spec.active(self.speculative.method) {
                continue;
            }
            let Some(info) = self.scheduler.request(*id) else {
                continue;
            };
            let known = info.num_prompt_tokens + info.num_output_tokens;
            if info.status != RequestStatus::Running || info.num_computed_tokens + 1 != known {
                continue;
            }
            if !a.spec.due() {
                // Resting: the head's guesses of the last step go unused.
                if let Some(m) = self.mtp.as_mut() {
                    m.take(*id);
                }
                continue;
            }
            let mut draft = a
                .spec
                .propose(&self.speculative, a.proc.prompt(), a.proc.generated());
            a.proc.trim_draft(&mut draft);
            if draft.is_empty() {
                if let Some(mut guess) = self.mtp.as_mut().and_then(|m| m.take(*id)) {
                    a.proc.trim_draft(&mut guess);
                    a.spec.drafted(guess.len());
                    draft = guess;
                }
            }
            if !draft.is_empty() {
                self.scheduler.propose(*id, draft);
            } else if self.draft.is_some() {
                let context = a.proc.context();
                let k = a.spec.next_length(self.speculative.num_tokens);
                for_draft.push((*id, context, k));
            }
        }
        let Some(draft) = self.draft.as_mut() else {
            return;
        };
        let active = &self.active;
        draft.retain(|id| active.contains_key(id));
        if for_draft.is_empty() {
            return;
        }
        match draft.propose(&for_draft) {
            Ok(drafts) => {
                for (id, mut tokens) in drafts {
                    if let Some(a) = self.active.get_mut(&id) {
                        a.proc.trim_draft(&mut tokens);
                        a.spec.drafted(tokens.len());
                    }
                    self.scheduler.propose(id, tokens);
                }
            }
            // The target decodes without guesses; the draft's failure is
            // its own (its cache starts over).
            Err(_) => draft.retain(|_| false),
        }
    }

    /// The MTP head after a step: its keys for the rows whose hidden states
    /// stand, and the next guesses of the requests going on (`seqs`: the
    /// step's batch, one a scheduled request, in order).
    pub(super) fn run_mtp(
        &mut self,
        hidden: &kiln_tensor::Tensor,
        scheduled: &[kiln_scheduler::ScheduledRequest],
        seqs: &[kiln_tensor::SeqSlice],
        valid: &HashMap<RequestId, usize>,
        finished: &[(RequestId, FinishReason)],
    ) {
        // (request, its first row and position, valid rows, guesses, context)
        let parts: Vec<(RequestId, usize, usize, usize, usize, Vec<TokenId>)> = scheduled
            .iter()
            .zip(seqs)
            .filter(|(s, _)| !finished.iter().any(|(id, _)| *id == s.id))
            .filter_map(|(s, seq)| {
                // A resting request skips the head (its keys restart where
                // it guesses again).
                let a = self.active.get(&s.id).filter(|a| !a.spec.resting())?;
                let valid = valid.get(&s.id).copied().unwrap_or(s.new_token_ids.len());
                let guesses = match s.wants_logits {
                    true => a.spec.next_length(self.speculative.num_tokens),
                    false => 0,
                };
                Some((
                    s.id,
                    seq.token_start,
                    seq.num_computed,
                    valid,
                    guesses,
                    a.proc.context(),
                ))
            })
            .collect();
        let rows: Vec<crate::mtp::StepRows<'_>> = parts
            .iter()
            .map(
                |(id, row, pos, valid, guesses, context)| crate::mtp::StepRows {
                    id: *id,
                    row: *row,
                    pos: *pos,
                    valid: *valid,
                    context,
                    guesses: *guesses,
                },
            )
            .collect();
        let Some(m) = self.mtp.as_mut() else {
            return;
        };
        // A failure is the head's own: its keys start over, the target
        // decodes without guesses.
        if m.after_step(hidden, &rows).is_err() {
            m.retain(|_| false);
        }
    }
}
