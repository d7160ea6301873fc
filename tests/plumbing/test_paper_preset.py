"""configs/paper/rm_nlhf_qwen7b.yaml against the RM-NLHF paper (issue 27 items 2 and 4): the D_H
share of Table 8's mix, with the arithmetic of its comment recomputed; the MetaRM cold start
sampled as Table 9's rollouts."""
import os
import re

from conftest import REPO
from plumbing.config import load_config

PAPER = os.path.join(REPO, "configs", "paper", "rm_nlhf_qwen7b.yaml")
HELPSTEER3, MIX = 36_255, 164_062  # RM-NLHF Table 8: HelpSteer3's pairs, the whole training mix


def number(text):
    return float(text.replace(",", ""))


def test_dh_share_is_table_8s_and_its_comment_adds_up():
    """nlhf.dh_per_step = HelpSteer3's share of the paper's mix, 36,255 / 164,062 = 0.221 (to 3
    places; before: 0.5, 4.24 passes over HelpSteer3 in 1200 steps instead of the paper's 1.87);
    every number of the comment above it is recomputed here from Table 8 and the preset's own
    batch and steps: round(0.221 x 256) = 57 D_H prompts a step, 57 x 1200 = 68,400 = 1.89 passes."""
    cfg = load_config([PAPER])
    share, P, steps = cfg["nlhf"]["dh_per_step"], cfg["rollout"]["prompts_per_step"], cfg["run"]["total_steps"]
    assert share == round(HELPSTEER3 / MIX, 3) == 0.221
    n_dh = round(share * P)
    assert (P, steps, n_dh) == (256, 1200, 57)
    text = open(PAPER).read()
    comment = " ".join(line.strip().lstrip("# ") for line in
                       text[text.index("# The paper trains on one mix"):text.index("  dh_per_step:")].splitlines())
    m = re.search(r"HelpSteer3 is ([\d,]+) of ([\d,]+) pairs, a share of ([\d,]+) / ([\d,]+) = ([\d.]+)", comment)
    assert m and [number(g) for g in m.groups()] == [HELPSTEER3, MIX, HELPSTEER3, MIX, share], comment
    m = re.search(r"(\d+) x (\d+) = ([\d,]+) prompts = ([\d,]+) / ([\d,]+) = ([\d.]+) passes", comment)
    assert m and [number(g) for g in m.groups()] == [P, steps, P * steps, P * steps, MIX,
                                                      round(P * steps / MIX, 2)], comment
    m = re.search(r"so ([\d,]+) x ([\d,]+) / ([\d,]+) = ([\d,]+) HelpSteer3 prompts = ([\d.]+) passes", comment)
    assert m and [number(g) for g in m.groups()] == [P * steps, HELPSTEER3, MIX, round(P * steps * HELPSTEER3 / MIX),
                                                      round(P * steps / MIX, 2)], comment
    m = re.search(r"round\(([\d.]+) x (\d+)\) = (\d+) D_H prompts a step: (\d+) x (\d+) = ([\d,]+) = ([\d.]+) passes",
                  comment)
    assert m and [number(g) for g in m.groups()] == [share, P, n_dh, n_dh, steps, n_dh * steps,
                                                      round(n_dh * steps / HELPSTEER3, 2)], comment
    m = re.search(r"share of 0.5 would be (\d+) x (\d+) = ([\d,]+) = ([\d.]+) passes", comment)
    assert m and [number(g) for g in m.groups()] == [P / 2, steps, P / 2 * steps, round(P / 2 * steps / HELPSTEER3, 2)]
    # the batch line says the same split
    assert f"{n_dh} D_H + {P - n_dh} D_O pairs (nlhf.dh_per_step {share})" in text


def test_cold_start_samples_as_table_9s_rollouts():
    """The cold start's rollouts (metarm.max_new_tokens / temperature) are the paper's rollouts
    (Table 9: 8192 tokens at T 0.7), as the GRPO rollouts of the same preset; before: 256 tokens at
    T 1.0, where a DeepSeek-R1-Distill GRM rarely reaches its verdict."""
    cfg = load_config([PAPER])
    m, r = cfg["metarm"], cfg["rollout"]
    assert (m["max_new_tokens"], m["temperature"]) == (r["max_new_tokens"], r["temperature"]) == (8192, 0.7)
