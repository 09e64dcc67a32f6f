"""The shapes a graph is captured at: few, and padded by little.

A CUDA graph replays fixed shapes, and fairseq's batches vary in rows and
lengths, so each is padded up to a bucket; one graph serves every batch of
a bucket.
"""


def bucket(n: int) -> int:
    """Time steps: n rounded up to a multiple of 8, or from 128 on of a
    sixteenth of the power of two below it. The loop's cost grows with its
    steps, so they are padded by little: less than 8 or n/8."""
    step = max(8, 2 ** (n.bit_length() - 4))
    return -(-n // step) * step


def bucket_wide(n: int) -> int:
    """Rows and source positions: the power of two at or above n (at least
    8). A step costs about the same for more of them, and --max-tokens
    batches pair many short rows with few long ones: one epoch of Debian
    de-en's batches fits in 40 graphs this way, against 101 with bucket()."""
    return max(8, 1 << (n - 1).bit_length())
