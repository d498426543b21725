package redis_test

import (
	"testing"

	goredis "github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/redis"
)

// Every go-redis option the scheme lets through is one go-redis reads: ParseURL refuses the
// others, so a list that drifted from the client would refuse a URL the client takes, or pass
// one it refuses. skip_verify needs TLS: rediss://.
func TestScheme_ClientParamsAreGoRedisOptions(t *testing.T) {
	t.Parallel()
	values := map[string]string{"db": "1", "protocol": "3", "client_name": "c", "pool_fifo": "true", "skip_verify": "true"}
	for _, p := range redis.ClientParams {
		v, ok := values[p]
		if !ok {
			v = "1" // a count, or a duration in seconds
		}
		_, err := goredis.ParseURL("rediss://127.0.0.1:6379/0?" + p + "=" + v)
		require.NoError(t, err, p)
	}
	_, err := goredis.ParseURL("redis://127.0.0.1:6379/0?grup=1")
	require.ErrorContains(t, err, "grup")
}
