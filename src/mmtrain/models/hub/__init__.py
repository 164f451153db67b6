"""Hub models: transformers' own classes, built from a user's folder and trained as they are,
behind the protocol native models implement (`spec`, `towers`, `forward(batch)`)."""
