"""The exact streamed backward over a shared-prefix token tree: a library for any Hugging Face causal
LM (docs/design.md §2–§5, §6b, §6c). It never imports the RL loop (`backstream.rl`) or quantization
(`backstream.quant`); tests/run/test_layout.py keeps it that way.

    tree, schedule            the token tree, which chunks form a block batch
    state, kvstore            layer state carried between blocks (one protocol): recurrent and
                              convolution states at block boundaries; the K/V store + gK/gV
    scan                      Mamba 1's selective scan continued from the state a block starts with
    vision                    a vision-language model's image rows as tree tokens, the tower's
                              gradient summed over blocks and backpropagated once
    attention                 shared-prefix attention merged by log-sum-exp, and its backward
    objective                 the per-block objective contract (BlockView, Objective, TokenWeights)
    hf, family, adapter       what the engine asks of a transformers model, the contract's guards, the
                              Cache / attention-function adapter
    fsdp                      FSDP2 around one call (gather once, reduce once)
    grads                     the parameters' gradients gathered over block batches (float32 for
                              16-bit weights; the embedding's rows; the LM head's in place)
    router, planner           the MoE load-balancing term; block size from a memory budget
    memory                    exact count of live tensor bytes during a call (peak, what is alive there)
    engine, reference         stream_backward / logprobs, and the naive full-sequence reference
    miniature, verify         a float64 miniature of any config; streamed vs reference on it
"""
