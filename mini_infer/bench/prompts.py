"""Benchmark prompts: built-in English texts tokenized into one token stream, cut into fixed or random requests.

Every system gets the same token ids, so tokenization never enters a timing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

TEXTS = (
    "The lighthouse keeper had not seen a ship in eleven days, which was unusual for late autumn. Each evening "
    "he climbed the spiral stairs, trimmed the wick and wrote the weather into a ledger nobody ever read.",
    "To make a good loaf of bread you need patience more than skill. Mix the flour, water, salt and a little "
    "yeast, then leave the dough alone overnight while the slow fermentation builds its flavour.",
    "In 1854 a physician in London mapped the cholera deaths around a single water pump on Broad Street and "
    "argued, against the common belief of his day, that the disease travelled through contaminated water.",
    "Dear members of the allotment committee, I am writing to raise once more the question of the shared "
    "compost heaps, which have become a source of friction between the north and south plots this summer.",
    "A hash table stores values in an array of buckets. A hash function turns each key into an index, and "
    "collisions, when two keys land in the same bucket, are resolved by chaining or by open addressing.",
    "The river starts as a trickle in the high moorland, gathers strength through a dozen small valleys and "
    "reaches the estuary as a broad, brown, slow-moving thing that barely seems to move at all.",
    "Quarterly revenue rose by four percent, driven mostly by the services division, while hardware sales "
    "remained flat. The board expects margins to improve once the new warehouse opens in the spring.",
    "She learned to sail on a borrowed dinghy with a torn jib and a rudder that stuck in the cold. By the end "
    "of her first season she could read a gust on the water a full minute before it arrived.",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts, water is split, oxygen "
    "is released, and the energy captured from sunlight is stored in the bonds of simple sugars.",
    "The village market opens at seven on Saturdays. By eight the cheese stall has a queue, the baker has sold "
    "out of rye, and the man who sharpens knives has set up his grinding wheel beside the fountain.",
    "When you debug a program, begin by reproducing the failure reliably. Then shrink the input step by step "
    "until the smallest case that still fails makes the cause obvious, or at least much easier to see.",
    "Mountain weather changes quickly. A clear morning can turn to fog by noon, and walkers who set out in "
    "shirtsleeves are often grateful for the extra layer and the map they nearly left behind.",
    "The orchestra tuned to a single oboe note while the hall slowly filled. Somewhere in the balcony a child "
    "asked, far too loudly, whether the conductor would be the one playing the biggest drum.",
    "Old maps are full of confident mistakes: islands that do not exist, rivers that flow the wrong way, and "
    "mountain ranges drawn wherever the cartographer had run out of other information to show.",
    "Our team meets every Monday to review the previous week. We look at what shipped, what slipped, and what "
    "we learned, and then we agree on the two or three things that matter most for the week ahead.",
    "Honeybees communicate the location of food with a waggle dance. The angle of the dance on the comb shows "
    "the direction relative to the sun, and the length of the waggle run encodes the distance.",
)


@dataclass(frozen=True, slots=True)
class TokenStream:
    """The texts' token ids concatenated (space-separated), and where each text starts in the stream."""

    token_ids: list[int]
    text_starts: list[int]

    def window(self, start: int, length: int) -> list[int]:
        """`length` ids from `start`, wrapping around the end of the stream."""
        size = len(self.token_ids)
        return [self.token_ids[(start + i) % size] for i in range(length)]


def load_stream(model_dir: str | Path) -> TokenStream:
    from mini_infer.engine.detokenizer import load_tokenizer

    tokenizer = load_tokenizer(Path(model_dir))
    if tokenizer is None:
        raise ValueError(f"model {model_dir} has no tokenizer.json; the benchmark prompts are real text")
    token_ids, starts = [], []
    for text in TEXTS:
        starts.append(len(token_ids))
        token_ids += tokenizer.encode(text + " ", add_special_tokens=False)
    return TokenStream(token_ids, starts)


def fixed_prompts(stream: TokenStream, num_prompts: int, prompt_len: int) -> list[list[int]]:
    """Prompt i opens with text i (cycling through the texts) and runs on into the next to fill `prompt_len`."""
    starts = stream.text_starts
    return [stream.window(starts[i % len(starts)], prompt_len) for i in range(num_prompts)]


@dataclass(frozen=True, slots=True)
class RandomRequests:
    prompts: list[list[int]]
    output_lens: list[int]


def random_requests(stream: TokenStream, num_requests: int, input_len_range: tuple[int, int],
                    output_len_range: tuple[int, int], seed: int) -> RandomRequests:
    """Input and output lengths uniform over the inclusive ranges; each prompt is a slice of the real text
    stream at a random offset."""
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(num_requests):
        start = rng.randrange(len(stream.token_ids))
        prompts.append(stream.window(start, rng.randint(*input_len_range)))
        output_lens.append(rng.randint(*output_len_range))
    return RandomRequests(prompts, output_lens)


# nano-vllm's bench.py: 256 requests, prompt and output lengths uniform in [100, 1024], token ids uniform in
# [0, 10000], Python's random seeded with 0, sampled at temperature 0.6 with EOS ignored.
NANO_VLLM_REQUESTS, NANO_VLLM_LOW, NANO_VLLM_HIGH, NANO_VLLM_MAX_ID, NANO_VLLM_TEMPERATURE = 256, 100, 1024, 10000, 0.6


def nano_vllm_requests() -> RandomRequests:
    """nano-vllm's benchmark requests, drawn in its order (each prompt's length, then its ids; then every output
    length) from the same seed, so the lengths are the ones its published figures ran."""
    rng = random.Random(0)
    prompts = [[rng.randint(0, NANO_VLLM_MAX_ID) for _ in range(rng.randint(NANO_VLLM_LOW, NANO_VLLM_HIGH))]
               for _ in range(NANO_VLLM_REQUESTS)]
    return RandomRequests(prompts, [rng.randint(NANO_VLLM_LOW, NANO_VLLM_HIGH) for _ in range(NANO_VLLM_REQUESTS)])
