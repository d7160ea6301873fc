"""Models loaded straight into FSDP2 shards (docs/scale-out.md "Memory plan", setup).

Under train.parallel fsdp2 the policy, the GRPO reference and the MetaRM are built on the meta
device (no memory), sharded there, and only then given their weights: rank 0 reads the checkpoint
once and broadcasts it tensor by tensor (torch.distributed.checkpoint.state_dict's
set_model_state_dict with broadcast_from_rank0), every rank keeping its 1/world slice. Before,
every rank read a full float32 copy and sharded it afterwards: at 7B 30.5 GB (policy) + 28.3 GB
(MetaRM) + 15.2 GB (reference) a GPU, 8 x 30.5 GB of host RAM read at once on one node, and the
freed full copies left reserved in the CUDA caching allocator when vLLM measured free memory.

    load_sharded_model(load, shard, device=, rank=, world=)   the loader; plumbing/run.py and metarm_setup.py call it
"""
import torch
import torch.distributed as dist

from plumbing.guards import stop_together


def load_sharded_model(load, shard, *, device, rank, world):
    """A model and its companion (the tokenizer) with no rank but 0 ever holding the full weights.

    1. Rank 0 calls `load()` -> (model on the CPU, companion), e.g. plumbing.models.load_model(path,
       dtype, "cpu"); a SystemExit there (a bad path) stops every rank with its one-line message
       (guards.stop_together), none is left waiting in a collective.
    2. Every rank builds the same architecture on the meta device, from rank 0's model class,
       config and generation config (broadcast, so each rank's model is the one rank 0 read:
       same dtype, attention implementation, tied embeddings; GGUF converted once, by rank 0),
       and `shard(model)` shards it there (wrap_policy, shard_frozen: fully_shard per decoder
       layer and the root; returns the model). `to_empty` then allocates this rank's shards only.
    3. set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True): rank 0 sends one
       tensor at a time, every rank keeps its slice (a rank != 0 holds its shards and one full
       tensor in flight, never the model). Buffers (RoPE's inv_freq: in no state dict) come from
       rank 0's model the same way. The companion is broadcast too (pickled).
    4. Rank 0 drops its copy; torch.cuda.empty_cache() returns the broadcast's transient blocks
       to the driver, before the vLLM engine (started next in setup) measures free memory.

    Args:
        load: callable () -> (torch.nn.Module on the CPU, companion); called on rank 0 only.
        shard: callable (module on the meta device) -> the sharded module (FSDP2 on `device`'s mesh).
        device: torch.device of the shards. rank, world: this process's rank and the world size
            (a process group exists: FSDP2 needs one even at world 1).
    Returns:
        (sharded model, companion): the weights equal load()'s exactly
        (tests/plumbing/test_scale.py::test_models_load_into_shards_from_rank_0).
    Raises:
        SystemExit: rank 0's load() failed (its message on rank 0, exit code 1 elsewhere).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    full, companion, problem = None, None, None
    if rank == 0:
        try:
            full, companion = load()
        except SystemExit as e:
            problem = str(e) or "the model could not be loaded"
    stop_together(problem, rank, world)
    box = [type(full), full.config, getattr(full, "generation_config", None), full.dtype, full.training, companion] \
        if rank == 0 else [None] * 6
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    cls, config, generation_config, dtype, training, companion = box
    with torch.device("meta"):
        model = cls._from_config(config, dtype=dtype)  # what from_pretrained builds, without weights
    model.train(training)  # from_pretrained's models come in eval mode
    if generation_config is not None:
        model.generation_config = generation_config
    model = shard(model)
    model.to_empty(device=device)
    set_model_state_dict(model, full.state_dict() if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, buf in model.named_buffers():  # not in the state dict when non-persistent
        if rank == 0:
            buf.copy_(full.get_buffer(name))
        if world > 1:
            dist.broadcast(buf, src=0)
    del full
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model, companion
