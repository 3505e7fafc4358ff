"""The operator layer: what `outbox-dispatcher status|dead|replay|pause|resume|cleanup|check` and
the console do, as data. Actions run through one flow (actions.perform); reads return snapshots
and rows; nothing here prints, renders or parses a command line (cli/ and console/ do)."""
