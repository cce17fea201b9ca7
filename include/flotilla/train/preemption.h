// Preemption, as TF's PreemptionCheckpointHandler handles it for Model::fit. While a fit runs
// with a callback that asks for it (BackupAndRestore with handle_preemption), SIGTERM to a
// worker no longer ends it: the process-wide request below is set instead, and fit puts each
// worker's request into a small vote at step boundaries; every worker sees the result at the
// same step, calls its callbacks' on_preemption() there (BackupAndRestore saves a backup) and
// throws Preempted ("exit 75: restart me"). The vote is fit's own collective, issued at the same
// point on every worker whatever their callbacks are; the start-up check makes the workers agree
// on whether and how often they vote.
#pragma once

namespace flotilla::train {

// Asks the running fits of this process to stop for preemption: the SIGTERM handler calls it
// (async-signal-safe: it sets one lock-free atomic). Model::request_preemption() asks one
// model's fit only (ranks as threads in one process need that one).
void request_preemption() noexcept;
// Whether a request is pending (set by request_preemption, cleared when a fit acts on it).
bool preemption_requested() noexcept;

} // namespace flotilla::train
