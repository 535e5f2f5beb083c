"""QA datasets for evaluation and training: the community formats read into one schema.

`qa` has no heavy dependencies; `tfds_builder` (TensorFlow Datasets) is imported only by who needs it.
"""

from asearcher_jax.data.qa import (
  SEARCH_R1_SOURCES,
  SHIPPED,
  DatasetError,
  QAExample,
  load_asearcher_layout,
  load_dataset,
  load_qa_file,
  load_search_r1,
)

__all__ = [
  "SEARCH_R1_SOURCES",
  "SHIPPED",
  "DatasetError",
  "QAExample",
  "load_asearcher_layout",
  "load_dataset",
  "load_qa_file",
  "load_search_r1",
]
