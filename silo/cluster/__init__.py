"""The cluster's shared state in Redis: membership and failure detection, directory, placement,
rebalancing and drain, durable reminders, the event log."""
