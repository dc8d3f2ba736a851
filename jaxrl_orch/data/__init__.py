"""Datasets and prompt sources for the bundled tasks.

``builders.py`` holds the tensorflow-datasets builders (array_record, no TensorFlow) and
``prepare``; ``sources.py`` turns a split or a text file into a checkpointable
``types.Source``; ``sentences.py`` and ``problems.py`` are the seeded generators behind the
bundled corpus and arithmetic problems. Import the submodules directly: importing this package
does not import tensorflow_datasets.
"""
