package kafkatest_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/broker/kafka/kafkatest"
)

func TestNew_StartsTheDefaultClusterAndItsURLNamesEveryBroker(t *testing.T) {
	t.Parallel()
	c := kafkatest.New(t)
	require.Len(t, c.Brokers(), kafkatest.DefaultBrokers)
	require.Equal(t, "kafka://"+c.Brokers()[0]+","+c.Brokers()[1]+","+c.Brokers()[2]+"/?group=g", c.URL("group=g"))

	cl, err := kgo.NewClient(kgo.SeedBrokers(c.Brokers()...))
	require.NoError(t, err)
	defer cl.Close()
	adm := kadm.NewClient(cl)
	_, err = adm.CreateTopic(context.Background(), -1, -1, nil, "orders")
	require.NoError(t, err)
	topics, err := adm.ListTopics(context.Background(), "orders")
	require.NoError(t, err)
	require.Len(t, topics["orders"].Partitions, kafkatest.DefaultPartitions)
}

func TestStart_RefusesANegativeField(t *testing.T) {
	t.Parallel()
	_, err := kafkatest.Start(kafkatest.Config{Partitions: -1})
	require.ErrorContains(t, err, "negative")
}
