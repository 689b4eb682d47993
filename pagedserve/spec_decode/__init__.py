"""Speculative decoding: proposers (n-gram prompt lookup), the rejection sampler that keeps the
output exactly the target's, the verify step's layout and the acceptance counters. The model
runner calls a proposer after each step and the rejection sampler instead of the sampler on a
step that verifies drafts; the scheduler schedules 1+K tokens for a request with K drafts and
rolls back the rejected ones (docs/architecture.md, "Speculative decoding")."""
