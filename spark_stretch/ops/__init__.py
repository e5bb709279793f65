"""Built-in O+ operators (aggregations, joins, examples from the STRETCH papers)."""
