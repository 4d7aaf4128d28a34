"""Cache-to-cache fusion on the reference pair and on the real catalog pair."""
