// placeholder: the status page's script
