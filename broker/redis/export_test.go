package redis

// ClientParams are the go-redis URL options the redis:// scheme accepts.
var ClientParams = clientParams
