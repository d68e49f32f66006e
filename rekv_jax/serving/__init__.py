"""The decode worker of a serving system: the paged cache's bookkeeping (`pages`)."""
