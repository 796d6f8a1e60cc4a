"""Solutions of notebook 12_prefix_caching, merged by `python -m orca_lab.course.solve`."""
# Each section is a notebook cell: it reads names the cells before it define.
# ruff: noqa: F821, E402, E741


# %% exercise: block_hashes
from orca_lab.engine.prefix_cache import block_hash

def block_hashes(tokens, block_size):
    names = []
    for i in range(len(tokens) // block_size):                  # full blocks only
        names.append(block_hash(names[-1] if names else None, tokens[i * block_size:(i + 1) * block_size]))
    return names


# %% exercise: cached_prefix
def cached_prefix(cache, prompt, block_size):
    n = 0
    for name in block_hashes(prompt[:-1], block_size):         # the last token is always computed
        if name not in cache:
            break                                               # the prefix ends at the first miss
        n += block_size
    return n


# %% exercise: block_lru
from collections import OrderedDict


class BlockLRU:
    def __init__(self):
        self.blocks = OrderedDict()             # free cached blocks, least recently freed first

    def freed(self, block):
        self.blocks[block] = None               # the most recently freed: at the end

    def used(self, block):
        del self.blocks[block]                  # held again: never evicted while held

    def evict(self):
        return self.blocks.popitem(last=False)[0]

    def __len__(self):
        return len(self.blocks)


# %% exercise: block_refs
class BlockRefs:
    def __init__(self, lru):
        self.lru = lru                          # where the free cached blocks wait
        self.counts = {}                        # block -> requests holding it; 0: free and cached

    def count(self, block):
        return self.counts.get(block, 0)

    def hold(self, block):
        if self.counts.get(block) == 0:         # free and cached: held now, never evicted
            self.lru.used(block)
        self.counts[block] = self.count(block) + 1

    def release(self, blocks, cached):
        freed = []
        for block in reversed(blocks):          # the last first: a prefix's tail is evicted first
            self.counts[block] -= 1
            if self.counts[block]:
                continue                        # another request still holds it
            freed.append(block)
            if block in cached:
                self.lru.freed(block)
            else:
                del self.counts[block]          # back to the pool: no count
        return freed

    def evict(self):
        block = self.lru.evict()
        del self.counts[block]                  # back to the pool
        return block


# %% exercise: hit_tokens
hit_tokens = 24
prefill_tokens = 13
