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
    """Varies across the samples of a random model, so group advantages are non-zero. BATCHRL_TEST_DIGIT_WEIGHT
    scales it: a change of behaviour that neither the config nor this module's source shows (test_faults)."""
    import os

    return float(os.environ.get("BATCHRL_TEST_DIGIT_WEIGHT", "1")) * sum(ch.isdigit() for ch in response)


def sleeps_forever(response, ground_truth, **row):
    import time

    while True:
        time.sleep(60)


def hangs_on_second_sample(response, ground_truth, *, sample_idx, **row):
    """Hangs (without sleeping, a busy loop) on sample_idx 1 only; otherwise the length of the response."""
    while sample_idx == 1:
        pass
    return float(len(response))


def dies_on_hang(response, ground_truth, **row):
    """Kills its own process when the response says so, as a segfaulting C extension would."""
    import os

    if response == "hang":
        os._exit(7)
    return 1.0


def scaled_length(response, ground_truth, *, scale, **row):
    return scale * len(response)
