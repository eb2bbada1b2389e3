"""Reports: the JSON report and model card, the HTML page, the plots."""
