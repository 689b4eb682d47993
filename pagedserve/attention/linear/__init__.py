"""Linear-attention state ops for hybrid models' recurrent layers, in plain torch (the CPU path
and the reference of the Triton kernels in `attention/ops/gdn_kernels.py` and
`attention/ops/lightning_kernels.py`).

- `gdn_torch`: the gated delta rule of Qwen3-Next's gated delta net layers.
- `lightning_torch`: MiniMax-Text-01's lightning attention (linear attention, per-head decay).

Calling convention, as the Mamba ops: a step's tokens are packed [T, ...] in batch order,
prefills first, then decodes (one token each). Per request, `query_start_loc` [B+1] (token
offsets), `state_indices` [B] (its slot in the state tensor) and `has_initial_state` [B] (False:
start from zeros, whatever the slot holds). States are float32 [num_slots, H, Dk, Dv], the
running sum of key-value outer products, so a token's output is q @ state. Prefill ops write each
request's final state back into its slot; decode ops advance each slot one token.
"""
