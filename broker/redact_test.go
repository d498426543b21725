package broker_test

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/sqldb"
	_ "github.com/onceflow/onceflow/sqldb/mysql"
	_ "github.com/onceflow/onceflow/sqldb/postgres"
)

// One redaction serves database and broker URLs: every secret that sqldb.Redact hides, a
// Broker hides in its String and in its errors, as the same text.
func TestRedact_BrokerAndDatabaseHideTheSameSecrets(t *testing.T) {
	t.Parallel()
	const secret = "s3cr3t-Pw"
	for _, raw := range []string{
		"mem://user:" + secret + "@host/",
		"mem://host/?password=" + secret,
		"mem://host/?sslpassword=" + secret,
		"mem://host/?token=" + secret,
		"amqp://guest:" + secret + "@127.0.0.1:1/?prefetch=x",
		"nats://" + secret + "@127.0.0.1:1/?prefetch=x",
		"nats://host:1/?token=" + secret + "&prefetch=x",
		"redis://:" + secret + "@127.0.0.1:1/0?prefetch=x",
		"postgres://app:" + secret + "@127.0.0.1:1/db?sslpassword=" + secret + "&prefetch=x",
		"mysql://app:" + secret + "@127.0.0.1:1/db?prefetch=x",
	} {
		t.Run(raw[:strings.Index(raw, ":")], func(t *testing.T) {
			want := sqldb.Redact(raw)
			require.NotContains(t, want, secret, raw)
			b, err := broker.Open(context.Background(), raw, broker.Options{})
			if err != nil {
				require.Contains(t, err.Error(), want)
				require.NotContains(t, err.Error(), secret)
				return
			}
			t.Cleanup(func() { _ = b.Close() })
			require.Equal(t, want, b.String())
		})
	}
	for _, raw := range []string{
		"postgres://app:" + secret + "@127.0.0.1:1/db?sslpassword=" + secret + "&connect_timeout=1s",
		"mysql://app:" + secret + "@127.0.0.1:1/db?connect_timeout=1s",
	} {
		t.Run("sqldb "+raw[:strings.Index(raw, ":")], func(t *testing.T) {
			_, err := sqldb.Open(context.Background(), raw)
			require.Error(t, err)
			require.Contains(t, err.Error(), sqldb.Redact(raw))
			require.NotContains(t, err.Error(), secret)
		})
	}
}
