"""Reading and editing configs' text, knowing nothing of any training framework: bash read as bash reads it,
every character traced to where a file writes it (`bash_words`, `bash_shell`, `bash_script`, `provenance`),
YAML values replaced in place (`yaml_splice`), Python source edited at `ast`'s positions (`python_source`)."""
