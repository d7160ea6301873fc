"""Rewards: answer extraction, RLVR, the RLME meta-evaluation reward, and the RM-NLHF rewards.

SPEC §4.2-4.3 (RLME) and §5.2-5.3 (RM-NLHF). Every function works on plain strings, lists and
tensors so a reader can recompute any logged reward by hand from samples.jsonl.
"""
import math
import re

import torch


# ----------------------------------------------------------------------------------------------
# Answer extraction and RLVR (SPEC §4.3)


def extract_boxed(text):
    """Content of the LAST `\\boxed{...}` in `text`, braces matched (nested braces allowed).

    A naive regex stops at the first '}' and breaks on `\\boxed{\\frac{1}{2}}`. Also accepts
    `\\boxed 5` (a single token without braces) and `\\fbox{}`.

    Args:
        text: str, a completion.
    Returns:
        str, the stripped box content, or None when there is no (closed) box.
    """
    if not text:
        return None
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*", text)]
    for start in reversed(starts):
        if start < len(text) and text[start] == "{":
            depth = 0
            for i in range(start, len(text)):
                if text[i] == "{":
                    depth += 1
                elif text[i] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[start + 1:i].strip()
            continue  # unclosed box: try the one before it
        m = re.match(r"[^\s$]+", text[start:])  # '\boxed 5'
        if m:
            return m.group(0).strip()
    return None


def clean_gsm8k_label(answer):
    """GSM8K gold answer: the text after '####', with ',', '$' and spaces removed.
    '... #### 1,234' -> '1234'. Raises ValueError when there is no '####'."""
    if "####" not in answer:
        raise ValueError("GSM8K answer has no '####' line")
    return clean_number(answer.split("####")[-1])


def clean_number(s):
    """Strip the decorations a number may carry in a box or a label: ',', '$', spaces, a
    trailing '.', '%', and a wrapping \\text{...}."""
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = s.replace(",", "").replace("$", "").replace(" ", "").replace("\\%", "").replace("%", "")
    return s.rstrip(".")


def to_number(s):
    """'42' -> 42, '3.50' -> 3.5, '1/2' or '\\frac{1}{2}' -> 0.5; None when not a number."""
    if s is None:
        return None
    s = clean_number(s)
    m = re.fullmatch(r"\\d?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}|(-?[\d.]+)/(-?[\d.]+)", s)
    try:
        if m:
            num, den = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
            return float(num) / float(den)
        return int(s) if re.fullmatch(r"-?\d+", s) else float(s)
    except (ValueError, ZeroDivisionError):
        return None


def numeric_equal(pred, label):
    """GSM8K answer equivalence: both parse as numbers and are equal (int, float fallback with a
    1e-6 relative tolerance). pred None (no box) -> False."""
    a, b = to_number(pred), to_number(label)
    if a is None or b is None:
        return False
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def rlvr_reward(completion, label):
    """RLVR baseline reward (SPEC §4.3): 1.0 if the last boxed answer equals the cleaned label,
    else 0.0 (no box -> 0.0)."""
    return 1.0 if numeric_equal(extract_boxed(completion), label) else 0.0


# ----------------------------------------------------------------------------------------------
# RLME meta-evaluation reward (SPEC §4.2, RLME Eq. 2-3)


# ----------------------------------------------------------------------------------------------
# RM-NLHF (SPEC §5.1-5.3): pairwise data, GRM prompt and parsing, critique judge, rewards
