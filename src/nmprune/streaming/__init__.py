"""Pruning and evaluating models larger than memory, one decoder block at a time.

* :mod:`.files`: a safetensors checkpoint (one file or shards with an index), checked up
  front and read tensor by tensor through memory-mapped ``safe_open`` handles;
* :mod:`.source`: the model skeleton on the meta device, with one block's (or the
  embeddings' and head's) parameters materialised from the checkpoint on demand;
* :mod:`.sink`: the pruned model written shard by shard as each block is final;
* :mod:`.evaluate`: perplexity computed block by block.
"""

from .files import SafetensorsFiles
from .sink import ShardedWriter
from .source import StreamingModel

__all__ = ["SafetensorsFiles", "ShardedWriter", "StreamingModel"]
