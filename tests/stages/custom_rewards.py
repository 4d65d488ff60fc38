"""Reward functions used by the stage tests through score.rewards 'module:function' references."""


def explodes(response, ground_truth, **row):
    raise RuntimeError("boom")


def not_a_number(response, ground_truth, **row):
    return float("nan")


def gives_up(response, ground_truth, **row):
    return None


def length_bonus(response, ground_truth, **row):
    return len(response) / 10


def digit_count(response, ground_truth, **row):
    """Varies across the samples of a random model, so group advantages are non-zero."""
    return float(sum(ch.isdigit() for ch in response))
