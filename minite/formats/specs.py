"""PLACEHOLDER for chapter 01: FormatSpec, encode, decode."""
FormatSpec = FP32 = FP16 = BF16 = E4M3 = E5M2 = None


def encode(x, spec):
    raise NotImplementedError("chapter 01")


def decode(bits, spec):
    raise NotImplementedError("chapter 01")
