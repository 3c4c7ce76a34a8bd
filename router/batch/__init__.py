"""OpenAI's Files and Batch API, durable: files and batches in SQLite in the deployment's state
folder, run by one runner at flex priority (api: the handlers; files: upload and JSONL check;
store: the database; runner: the loop; lines: one line through its endpoint's handler;
objects: OpenAI's shapes)."""
