"""The VSN engine: ESG, shared buckets, owner map, epochs and O+ operators. No Spark import here."""
