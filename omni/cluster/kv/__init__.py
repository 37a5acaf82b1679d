"""The cluster's KV: which worker holds which pages (`directory`, fed by the workers' page
`events`) and fetching pages from a peer worker (`peers`)."""
