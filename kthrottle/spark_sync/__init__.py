"""The periodic PySpark job that publishes cluster state for the proxies."""
