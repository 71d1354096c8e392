"""The passkey retrieval format of train/MODEL.md ("Passkey retrieval"), shared by training
(train/train.py) and the evaluation prompts (train/make_passkey.py).

    prompt = F1 + NEEDLE(K) + F2 + QUESTION,   answer = K (5 ASCII digits, 00000-99999)
    NEEDLE(K) = "\\nThe pass key is K. Remember it. K is the pass key.\\n"
    QUESTION  = "\\nWhat is the pass key? The pass key is "

F1 and F2 are consecutive slices of a filler text (bytes), cyclic, starting at a random
offset; len(F1) = round(depth * (L - len(NEEDLE) - len(QUESTION))), len(F2) the rest, so
the prompt is exactly L bytes (= L tokens). In training, a passkey sequence is the prompt
followed by K + ".\\n".
"""
if __name__ == "__main__":  # a module, not a command: --help says what it is
    import argparse
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog="A module imported by the scripts of train/; running it does nothing.").parse_args()
    raise SystemExit(0)

import numpy as np

QUESTION = b"\nWhat is the pass key? The pass key is "
KEY_DIGITS = 5
ANSWER_SUFFIX = b".\n"


def needle(key):
    k = key.encode("ascii")
    return b"\nThe pass key is " + k + b". Remember it. " + k + b" is the pass key.\n"


NEEDLE_LEN = len(needle("0" * KEY_DIGITS))


def random_key(rng):
    return "".join(str(int(d)) for d in rng.integers(0, 10, KEY_DIGITS))


def filler(src, start, n):
    """n bytes of src (a bytes-like / uint8 array) from start, wrapping around."""
    src = np.asarray(src, dtype=np.uint8) if not isinstance(src, np.ndarray) else src
    start %= len(src)
    if start + n <= len(src):
        return src[start:start + n].tobytes()
    out = bytearray()
    while len(out) < n:
        take = min(n - len(out), len(src) - start)
        out += src[start:start + take].tobytes()
        start = 0
    return bytes(out)


def make_prompt(src, length, depth, key, start):
    """The prompt of `length` bytes with the needle at fractional depth (0..1)."""
    free = length - NEEDLE_LEN - len(QUESTION)
    if free < 0:
        raise ValueError("length %d is shorter than the needle and question (%d)"
                         % (length, NEEDLE_LEN + len(QUESTION)))
    n1 = int(round(depth * free))
    n2 = free - n1
    p = filler(src, start, n1) + needle(key) + filler(src, start + n1, n2) + QUESTION
    assert len(p) == length
    return p


# The multi-needle variant (evaluation only): several named keys, the question names one.
NAMES = (b"amber", b"cobalt", b"crimson", b"ivory", b"jade", b"onyx", b"saffron", b"teal")


def named_needle(name, key):
    k = key.encode("ascii")
    return (b"\nThe pass key of " + name + b" is " + k + b". Remember it. " + k +
            b" is the pass key of " + name + b".\n")


def named_question(name):
    return b"\nWhat is the pass key of " + name + b"? The pass key of " + name + b" is "


def make_multi_prompt(src, length, depths, names, keys, asked, start):
    """The prompt of `length` bytes with the needle of names[i] (key keys[i]) at fractional
    depth depths[i] of the filler, ending in the question for names[asked]. Returns the prompt
    and the byte offset of each needle."""
    needles = [named_needle(n, k) for n, k in zip(names, keys)]
    question = named_question(names[asked])
    free = length - sum(len(x) for x in needles) - len(question)
    if free < 0:
        raise ValueError("length %d is shorter than the needles and question" % length)
    order = sorted(range(len(names)), key=lambda i: depths[i])
    out, offsets, used = b"", [0] * len(names), 0
    for i in order:
        n = int(round(depths[i] * free)) - used
        out += filler(src, start + used, n)
        used += n
        offsets[i] = len(out)
        out += needles[i]
    out += filler(src, start + used, free - used) + question
    assert len(out) == length
    return out, offsets


def training_sequence(src, total, rng):
    """A training sequence of `total` bytes: prompt + key + ".\\n". Returns (bytes, answer
    start index) where bytes[answer_start:answer_start+5] is the key."""
    key = random_key(rng)
    plen = total - KEY_DIGITS - len(ANSWER_SUFFIX)
    depth = float(rng.random())
    start = int(rng.integers(0, len(src)))
    p = make_prompt(src, plen, depth, key, start)
    return p + key.encode("ascii") + ANSWER_SUFFIX, plen
