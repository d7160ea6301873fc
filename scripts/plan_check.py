"""The memory plan measured on ONE GPU as rank 0 of a world-8 run (issue 34; docs/scale-out.md "GPU check").

    python scripts/gpu_check.py plan-check --out plan_check.json [--budget-s 540] [--world 8] [--preset FILE[+FILE][+KEY=VALUE]]...
    python scripts/gpu_check.py plan-check --smoke --device cpu --out x.json      # tiny shapes (tests/plumbing/test_gpu_check.py)

torch's fake process group (`init_process_group("fake")`: every collective returns at once, its
output buffers allocated but not filled) makes this one process rank 0 of `--world` ranks, so
FSDP2 gives it exactly the 1/world shards, gathered layers and reduce-scatter buffers a GPU of
the real node holds, with real shapes, on one GPU. Per preset it builds the models on the meta
device, shards them with the project's own wrapping (plumbing/scale.py wrap_policy, shard_frozen;
the MetaRM as plumbing/metarm_setup.py load_metarm places it), materialises the shards only, and runs
each stage of plumbing/plan.py's plan through the project's own code:
    cold start / validation / rollout (HF)  fast.sample_rows under plumbing.scale.unsharded: the
                              prefill, the full StaticCache, the first token (greedy, every id an
                              EOS: the garbage weights a fake all-gather leaves stay harmless)
    cold-start fit, MetaRM update           metarm.fit on the rank's share of metarm.batch_size
    MetaRM predict                          metarm.raw_outputs on metarm.batch_size inputs
    setup                     set_model_state_dict(broadcast_from_rank0) from a full float32 state
                              dict in host RAM (rank 0's part of the meta-device load)
    reward (RLME)             fast.score_targets through the sharded policy
    update                    train.update_policy, its settings from the preset (>= 2 micro-batches)
    checkpoint                get_model_state_dict(full_state_dict, cpu_offload), one model at a time
and prints the plan's torch share of the stage (its bytes without the reserve and vLLM's pool)
next to torch.cuda.max_memory_allocated during the stage, their ratio, and max_memory_reserved /
allocated (the fragmentation the plan's reserve assumes: 10 %). Inputs are random ids of the
preset's lengths; the inputs' values, and so the numbers computed, are meaningless; the memory is
not. vLLM stages hold the engine's own pool, which is not measured here (no vLLM on the machine):
for them the torch part (what is resident beside the engine) is.

What only a GPU can confirm: every measured figure (on the CPU there is no
max_memory_allocated: the smoke mode proves the script runs every stage within its budget);
NCCL's communicator memory (the fake group has none) and the CUDA context (reported from
mem_get_info) are outside torch's counters.

The run stops inside --budget-s: a stage that would start with less than --stage-min-s left is
skipped, and a timer interrupts a stage that overruns; the JSON is rewritten after every stage.
"""
import argparse
import copy
import gc
import json
import os
import signal
import sys
import tempfile
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
GIB = 2**30
PAPER = "configs/paper/rm_nlhf_qwen7b.yaml"
# A preset: config files layered over config.yaml, and key=value overrides after them. In order of
# what they prove: every RM-NLHF stage through HF decode (4B; rollout.backend=hf, the fallback one key
# away: the shipped presets roll out with vLLM, whose stages hold the engine's pool, not measured
# here), the paper preset (7B, vLLM), RLME as shipped (4B, vLLM: the evaluator's scoring and the
# update), Llama-8B, the RLME crowd's frozen evaluators
HF = "rollout.backend=hf"
PRESETS = [["configs/rm_nlhf.yaml", HF], [PAPER], [], [PAPER, "configs/paper/table10/llama8b.yaml"],
           ["configs/paper/rlme/crowd.yaml"]]
SMOKE_PRESETS = [["configs/rm_nlhf.yaml", HF], [PAPER], []]
SMOKE_SHAPE = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512)
SMOKE = ["rollout.max_new_tokens=16", "rollout.prompts_per_step=16", "data.max_prompt_tokens=24", "nlhf.max_prompt_tokens=24",
         "metarm.max_length=48", "metarm.max_new_tokens=8", "nlhf.val_max_new_tokens=16", "nlhf.val_size=8",
         "train.logprob_chunk_tokens=16", "reward.micro_batch_size=2"]


class OutOfBudget(Exception):
    pass


def _alarm(signum, frame):
    raise OutOfBudget()


def tiny_copy(path, out_dir):
    """A config.json of the model at `path` with SMOKE_SHAPE (its own architecture), in a folder:
    what the smoke mode plans and builds instead of the real size."""
    from transformers import AutoConfig
    from plumbing.plan import model_config
    d = model_config(path).to_dict()
    d.update(SMOKE_SHAPE, **({"head_dim": 16} if d.get("head_dim") else {}))
    if d.get("head_dim") is None:
        d.pop("head_dim", None)  # hidden / heads, as the model computes it
    d.pop("layer_types", None)  # one per layer: rebuilt for the tiny depth
    folder = os.path.join(out_dir, path.replace("/", "--"))
    AutoConfig.for_model(d.pop("model_type"), **d).save_pretrained(folder)
    return folder


def preset_config(preset, smoke, tmp):
    """The loaded config of a preset (its files layered over config.yaml, then its key=value
    entries as overrides); smoke: tiny models and lengths."""
    from plumbing.config import load_config
    files = [os.path.join(ROOT, f) for f in preset if "=" not in f]
    keys = [f for f in preset if "=" in f]
    cfg = load_config(files, keys)
    if not smoke:
        return cfg
    over = keys + list(SMOKE) + [f"model.policy={tiny_copy(cfg['model']['policy'], tmp)}"]
    if cfg["metarm"]["model"]:
        over.append(f"metarm.model={tiny_copy(cfg['metarm']['model'], tmp)}")
    return load_config(files, over)


def fill(model):
    """Finite values in the local shards and buffers (to_empty leaves garbage): normal(0, 0.02)
    weights, norms' weights 1, float buffers (RoPE's inverse frequencies) 1e-2."""
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            local = t.to_local() if hasattr(t, "to_local") else t
            if not local.is_floating_point():
                continue
            if name.endswith("norm.weight") or "layernorm" in name:
                local.fill_(1.0)
            elif isinstance(t, torch.nn.Parameter):
                local.normal_(0.0, 0.02)
            else:
                local.fill_(1e-2)


def meta_build(config, *, num_labels=None, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    with torch.device("meta"):
        if num_labels is None:
            return AutoModelForCausalLM.from_config(config, dtype=dtype)
        config = copy.deepcopy(config)
        config.num_labels, config.pad_token_id = num_labels, 0
        return AutoModelForSequenceClassification.from_config(config, dtype=dtype)


class RandomTokenizer:
    """The MetaRM's tokenizer stand-in: every text becomes `length` random ids (the preset's
    metarm.max_length, the longest input it trains on), the last row of a batch padded a little:
    on the right, as load_metarm sets the real one (metarm.forward checks the two sides)."""
    padding_side, truncation_side = "right", "left"

    def __init__(self, vocab, length, seed=0):
        self.vocab, self.length, self.g = vocab, length, torch.Generator().manual_seed(seed)

    def __call__(self, texts, **kw):
        from transformers import BatchEncoding
        ids = torch.randint(1, self.vocab, (len(texts), self.length), generator=self.g)
        mask = torch.ones_like(ids)
        if len(texts) > 1:
            mask[-1, -3:] = 0
            ids[-1, -3:] = 0
        return BatchEncoding({"input_ids": ids, "attention_mask": mask})


def allocate_adamw(params, lr=1e-6):
    """AdamW as plumbing/run.py start_run builds it (fused), its state allocated by one step on zero gradients."""
    params = [p for p in params if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, fused=True)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


def prompts(n, length, vocab, seed, ragged):
    """n prompt id lists of `length` tokens; ragged: every second one 3 shorter (left padding, a mask)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length - (3 if ragged and i % 2 else 0),), generator=g).tolist() for i in range(n)]


def decode(model, *, rows, group, micro, prompt_tokens, new_tokens, vocab, context):
    """One HF decode call of the stage (fast.sample_rows, as fast.generate runs a micro-batch)
    under `unsharded`: prefill of the distinct prompts, the StaticCache of prompt + new_tokens,
    the first token. Greedy with every id an EOS, so the loop ends there."""
    import fast
    from plumbing.scale import unsharded
    from rollout import eval_mode
    m = min(micro or rows, rows)
    distinct = prompts(-(-m // group), prompt_tokens, vocab, 1, ragged=True)
    rows_ids = [p for p in distinct for _ in range(group)][:m]
    d, counts = fast.prompt_runs(rows_ids)
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    with unsharded(model), context(), eval_mode(model), torch.no_grad():
        fast.sample_rows(model, d, counts, max_new_tokens=new_tokens, eos=list(range(vocab)), pad_id=0, temperature=0.0,
                         top_p=1.0, top_k=0, generator=g)


def metarm_dict(model, cfg, world, vocab):
    """mrm as plumbing/metarm_setup.py load_metarm returns it, its tokenizer a RandomTokenizer."""
    import metarm
    from plumbing.scale import metarm_seams
    mr = cfg["metarm"]
    return {"model": model, "shard": (0, world), "tokenizer": RandomTokenizer(vocab, mr["max_length"]), "optimizer": None,
            "mode": mr["mode"], "lam": cfg["nlhf"]["lam"], "batch_size": mr["batch_size"], "max_length": mr["max_length"],
            "online_lr": mr["online_lr"], "online_epochs": mr["online_epochs"], "truncated": 0,
            "weight_decay": mr["weight_decay"], "updates": 0, "dtype": mr["dtype"],
            "seams": metarm_seams(metarm.raw_outputs, 0, world, sharded=True)}


def host_hwm_reset():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def host_gib(field):
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field)) / 2**20
    except (OSError, StopIteration):
        return None


def compare(plan, stage, measured_bytes, reserved_bytes):
    """The plan's torch share of `stage` (its bytes less the reserve and vLLM's pool) against the
    measured torch.cuda.max_memory_allocated (None off the GPU). Returns a dict of GiB and ratios."""
    st = plan["stages"][stage]
    engine = plan["items"].get("vLLM engine", 0) if "vLLM engine" in st["items"] else 0
    torch_part = st["bytes"] - st["reserve"] - engine
    out = {"planned_gib": torch_part / GIB, "planned_total_gib": st["bytes"] / GIB, "vllm_engine_gib": engine / GIB,
           "measured_gib": None, "ratio": None, "reserved_over_allocated": None}
    if measured_bytes is not None:
        out["measured_gib"] = measured_bytes / GIB
        out["ratio"] = measured_bytes / torch_part if torch_part else None
        out["reserved_over_allocated"] = reserved_bytes / measured_bytes if measured_bytes else None
    return out


def run(presets, *, out, device, world, budget_s, smoke, stage_min_s):
    """Plan and measure every stage of every preset inside budget_s seconds; writes `out` (JSON)
    after each stage and returns the result dict."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        dev = torch.device("cuda", dev.index if dev.index is not None else 0)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    t0 = time.monotonic()
    res = {"world": world, "device": str(dev), "smoke": smoke, "budget_s": budget_s, "gpu": torch.cuda.get_device_name(dev) if cuda else None,
           "torch": torch.__version__, "rows": [], "stopped": None}
    if cuda:
        free, total = torch.cuda.mem_get_info(dev)
        res["cuda_context_gib"] = (total - free - torch.cuda.memory_reserved(dev)) / GIB  # outside torch's allocator
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, max(0.01, budget_s))

    def save():
        res["seconds"] = time.monotonic() - t0
        with open(out, "w") as f:
            json.dump(res, f, indent=1)

    try:
        with tempfile.TemporaryDirectory() as tmp:
            for files in presets:
                if res["stopped"]:
                    break
                run_preset(files, res=res, save=save, dev=dev, world=world, smoke=smoke, tmp=tmp, t0=t0, budget_s=budget_s,
                           stage_min_s=stage_min_s)
    except OutOfBudget:
        res["stopped"] = f"budget of {budget_s} s reached"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    save()
    return res


def run_preset(files, *, res, save, dev, world, smoke, tmp, t0, budget_s, stage_min_s):
    import metarm
    import train
    from plumbing.plan import memory_plan, model_config
    from plumbing.run import update_kwargs
    from plumbing.scale import compute_context, shard_frozen, wrap_policy
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    name = "+".join(files) or "config.yaml"
    cuda = dev.type == "cuda"
    cfg = preset_config(files, smoke, tmp)
    plan = memory_plan(cfg, world=world, gpu_bytes=80 * GIB)
    m, t, ro, mr, task = cfg["model"], cfg["train"], cfg["rollout"], cfg["metarm"], cfg["task"]
    ctx = lambda: compute_context(m["dtype"], "fsdp2", dev)
    tp, tn, G, mb = plan["prompt_tokens"], ro["max_new_tokens"], ro["group_size"], t["micro_batch_size"]
    pconf = model_config(m["policy"])
    vocab = pconf.get_text_config().vocab_size
    rows = ro["prompts_per_step"] * G // world
    state = {}

    def stage(label, fn):
        if label not in plan["stages"]:
            return
        row = {"preset": name, "stage": label}
        left = budget_s - (time.monotonic() - t0)
        if res["stopped"] or left < stage_min_s:
            row["status"] = "skipped: budget"
            res["rows"].append(row)
            save()
            return
        vllm = "vLLM engine" in plan["stages"][label]["items"]
        gc.collect()
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        host_hwm_reset()
        rss0, s0 = host_gib("VmRSS:"), time.monotonic()
        try:
            fn()
            row["status"] = "measured" + (" (torch part; the vLLM engine's pool is not measured here)" if vllm else "")
        except OutOfBudget:
            row["status"] = "stopped: budget"
            res["stopped"] = f"budget of {budget_s} s reached in {name} {label}"
        except torch.OutOfMemoryError as e:
            row["status"] = f"OOM: {str(e).splitlines()[0][:200]}"
        except Exception as e:  # a stage that fails is reported, the others still run
            traceback.print_exc()
            row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        if cuda:
            torch.cuda.synchronize(dev)
        row["seconds"] = time.monotonic() - s0
        peak = torch.cuda.max_memory_allocated(dev) if cuda else None
        row.update(compare(plan, label, peak, torch.cuda.max_memory_reserved(dev) if cuda else None))
        hwm = host_gib("VmHWM:")
        row["host_gib"] = hwm - rss0 if hwm is not None and rss0 is not None else None
        if label in plan["host"]:
            row["planned_host_gib"] = plan["host"][label] / GIB
        res["rows"].append(row)
        save()
        unit, u = ("MiB", 2**20 / GIB) if smoke else ("GiB", 1.0)
        meas = f"{row['measured_gib'] / u:7.2f} {unit}, ratio {row['ratio']:.2f}, reserved/allocated {row['reserved_over_allocated']:.2f}" \
            if row["measured_gib"] is not None else "n/a (no CUDA max_memory_allocated here)"
        print(f"[plan-check] {name:40} {label:15} plan {row['planned_gib'] / u:7.2f} {unit} (with the reserve "
              f"{row['planned_total_gib'] / u:7.2f}), measured {meas} | {row['seconds']:.0f} s, {row['status']}", flush=True)
        if res["stopped"]:
            raise OutOfBudget()

    try:
        # the models: shards only, as the real node's rank 0 holds them
        policy = meta_build(pconf)
        wrap_policy(policy, "fsdp2", world, dev, dtype=m["dtype"], gradient_checkpointing=m["gradient_checkpointing"],
                    reduce_every_micro_batch=t["fsdp_reduce_every_micro_batch"])
        policy.to_empty(device=dev)
        fill(policy)
        state["policy"] = policy
        if "GRPO reference" in plan["items"] and plan["items"]["GRPO reference"]:
            ref = shard_frozen(meta_build(pconf, dtype=getattr(torch, m["dtype"])), world, dev)
            ref.to_empty(device=dev)
            fill(ref)
            state["ref"] = ref
        evals = []
        for e in cfg["reward"]["evaluators"] if task == "rlme" and plan["items"]["frozen evaluators"] else []:
            if e["kind"] in ("frozen", "frozen_self"):
                ev = meta_build(model_config(e["path"]) if e["kind"] == "frozen" else pconf, dtype=getattr(torch, m["dtype"]))
                ev.to_empty(device=dev)
                fill(ev)
                evals.append(ev.requires_grad_(False))
        state["evals"] = evals
        mrm = None
        if task == "rm_nlhf" and mr["mode"] != "none":
            mconf = model_config(mr["model"] or m["policy"])
            mm = meta_build(mconf, num_labels=3 if mr["mode"] == "classifier" else 1)
            if mr["gradient_checkpointing"]:  # as load_metarm: before sharding
                mm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            wrap_policy(mm, "fsdp2", world, dev, dtype=mr["dtype"])
            mm.set_reshard_after_forward(True, recurse=False)
            mm.to_empty(device=dev)
            fill(mm)
            mrm = metarm_dict(mm, cfg, world, mconf.get_text_config().vocab_size)
            state["mrm"] = mrm
        examples = [{"text": ".", "r": 1.0}] * mr["batch_size"]

        def metarm_fit():
            opt = mrm["optimizer"] or torch.optim.AdamW(mrm["model"].parameters(), lr=mr["online_lr"],
                                                       weight_decay=mr["weight_decay"])
            metarm.fit(mrm["model"], mrm["tokenizer"], examples, opt, **metarm.settings(mrm), epochs=1, seed=0,
                       share=mrm["seams"]["share"], mean=mrm["seams"]["mean"])
            mrm["optimizer"] = opt

        # a fresh run: the cold start comes before any AdamW state exists
        stage("cold start", lambda: decode(policy, rows=plan["cold_start_batch"] * mr["rollouts_per_prompt"],
                                           group=mr["rollouts_per_prompt"], micro=ro["micro_batch_size"], prompt_tokens=tp,
                                           new_tokens=mr["max_new_tokens"], vocab=vocab, context=ctx)
              if ro["backend"] == "hf" else None)
        stage("cold-start fit", metarm_fit)
        state["opt"] = allocate_adamw(policy.parameters(), lr=cfg["optim"]["lr"])
        if mrm is not None and mrm["optimizer"] is None and "MetaRM AdamW state" in plan["items"] and plan["items"]["MetaRM AdamW state"]:
            mrm["optimizer"] = allocate_adamw(mrm["model"].parameters(), lr=mr["online_lr"])

        def setup():  # rank 0 of the meta-device load: a full float32 state dict in host RAM, broadcast a tensor at a time
            full = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in policy.state_dict().items()}
            set_model_state_dict(policy, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
            del full

        stage("setup", setup)
        stage("rollout", lambda: decode(policy, rows=rows, group=G, micro=ro["micro_batch_size"], prompt_tokens=tp, new_tokens=tn,
                                        vocab=vocab, context=ctx) if ro["backend"] == "hf" else None)

        def reward():
            import fast
            sc = cfg["reward"]["micro_batch_size"]
            ps = prompts(sc, tp + tn + 128, vocab, 3, ragged=True)
            with ctx(), torch.no_grad():
                fast.score_targets(policy, [[p] for p in ps], [[[5]] for _ in ps], pad_id=0, micro_batch_size=sc)

        stage("reward", reward if task == "rlme" and cfg["reward"]["kind"] in ("rlme", "hybrid") else lambda: None)
        stage("MetaRM update", metarm_fit)
        stage("MetaRM predict", lambda: mrm["seams"]["outputs"](mrm["model"], mrm["tokenizer"], ["."] * mr["batch_size"],
                                                                 mode=mrm["mode"], batch_size=mrm["batch_size"],
                                                                 max_length=mrm["max_length"], dtype=mrm["dtype"]))

        def update():
            n = G * -(-2 * mb // G)  # whole groups, at least 2 micro-batches (FSDP2's accumulation shows)
            g = torch.Generator().manual_seed(4)
            ps = prompts(n // G, tp, vocab, 5, ragged=True)
            adv = torch.randn(n, generator=g)
            batch = {"prompt_ids": [p for p in ps for _ in range(G)], "completion_ids": torch.randint(1, vocab, (n, tn), generator=g),
                     "completion_mask": torch.ones(n, tn), "advantages": adv - adv.view(-1, G).mean(-1).repeat_interleave(G)}
            if ro["backend"] == "vllm":
                batch["rollout_logprobs"] = torch.zeros(n, tn)  # the behaviour pass that logs vLLM's gap runs
            passes = train.fast_or_plain(t["fast_paths"], t["logprob_chunk_tokens"])
            # bound as train.train binds them; the forwards' context is this rehearsal's (FSDP2 always)
            settings = update_kwargs(cfg, passes, dev, cispo_loss=train.cispo_loss, grpo_loss=train.grpo_loss,
                                     world=world, pad_id=0, ref_model=state.get("ref"))
            train.update_policy(policy, policy, state["opt"], batch, **dict(settings, context=ctx))

        stage("update", update)
        if task == "rm_nlhf":
            vs = cfg["nlhf"]["val_size"]  # 0: the whole file, in calls of a rollout's rows (plumbing/validation.py)
            vr, vn = (min(2 * -(-vs // world), ro["prompts_per_step"] * G // world) if vs else ro["prompts_per_step"] * G // world,
                      cfg["nlhf"]["val_max_new_tokens"])
        else:
            vr, vn = -(-cfg["data"]["val_size"] // world), tn
        stage("validation", lambda: decode(policy, rows=vr, group=1, micro=ro["micro_batch_size"] if task == "rm_nlhf" else 0,
                                           prompt_tokens=tp, new_tokens=vn, vocab=vocab, context=ctx)
              if ro["backend"] == "hf" else None)

        def checkpoint():  # one model at a time: the policy's full float32 state to rank 0's host RAM, then the MetaRM's
            for model in [policy] + ([mrm["model"]] if mrm else []):
                full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
                del full

        stage("checkpoint", checkpoint)
    finally:
        state.clear()
        policy = mrm = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--world", type=int, default=8, help="the world size the plan is for (fake process group)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop inside this many seconds (default 9 minutes)")
    ap.add_argument("--stage-min-s", type=float, default=None,
                    help="skip a stage that would start with less than this left (default 25 s on a GPU, 0 in --smoke)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes of each preset's architecture and lengths (the CPU test)")
    ap.add_argument("--preset", action="append", default=None,
                    help="config files joined by '+' (layered over config.yaml), then key=value overrides, e.g. "
                         "configs/rm_nlhf.yaml+rollout.backend=hf; 'config.yaml' alone = the defaults; repeatable")
    a = ap.parse_args(argv)
    presets = ([[f for f in p.split("+") if f != "config.yaml"] for p in a.preset] if a.preset
               else SMOKE_PRESETS if a.smoke else PRESETS)
    res = run(presets, out=a.out, device=a.device, world=a.world, budget_s=a.budget_s, smoke=a.smoke,
              stage_min_s=a.stage_min_s if a.stage_min_s is not None else (0.0 if a.smoke else 25.0))
    done = sum(r["status"].startswith("measured") for r in res["rows"])
    print(f"[plan-check] {done} of {len(res['rows'])} stages run in {res['seconds']:.0f} s"
          + (f"; stopped: {res['stopped']}" if res["stopped"] else "") + f"; {a.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
