"""A user's script as Kai Zhang's DDP tutorial writes it (its ENV mode), run on the CPU with Gloo and made-up
MNIST-sized images: a BatchNorm ConvNet evaluated through the DDP wrapper, a DistributedSampler on the test set
too, the two sums reduced to rank 0, and no destroy_process_group.

    torchrun --standalone --nproc-per-node 2 kaizhang_style.py -b 64 -e 2 [--exact]
"""
# ruff: noqa: UP008, UP032, B007 - written as the tutorial writes it

import argparse
from datetime import datetime

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import Subset, TensorDataset


class ConvNet(nn.Module):
    def __init__(self, num_classes=10):
        super(ConvNet, self).__init__()
        self.layer1 = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2))
        self.layer2 = nn.Sequential(
            nn.Conv2d(16, 32, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2))
        self.fc = nn.Linear(7 * 7 * 32, num_classes)

    def forward(self, x):
        out = self.layer1(x)
        out = self.layer2(out)
        out = out.reshape(out.size(0), -1)
        out = self.fc(out)
        return out


def fake_mnist(n, seed):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.rand(n, 1, 28, 28, generator=g) * 0.5
    images[torch.arange(n), 0, labels * 2 + 4, 4:24] += 0.5  # a learnable bar per class
    return TensorDataset(images, labels)


def evaluate(model, gpu, test_loader, rank):
    model.eval()
    size = torch.tensor(0.)
    correct = torch.tensor(0.)
    with torch.no_grad():
        for i, (images, labels) in enumerate(test_loader):
            outputs = model(images)
            size += images.shape[0]
            correct += (outputs.argmax(1) == labels).type(torch.float).sum()
    dist.reduce(size, 0, op=dist.ReduceOp.SUM)
    dist.reduce(correct, 0, op=dist.ReduceOp.SUM)
    if rank == 0:
        print('Evaluate accuracy is {:.2f}'.format(correct / size))


def train(gpu, args):
    dist.init_process_group(backend='gloo', init_method='env://')
    args.rank = dist.get_rank()
    model = ConvNet()
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), 1e-2)
    model = nn.parallel.DistributedDataParallel(model)
    train_dataset = fake_mnist(640, 0)
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
    train_loader = torch.utils.data.DataLoader(dataset=train_dataset, batch_size=args.batch_size, shuffle=False,
                                               num_workers=0, pin_memory=False, sampler=train_sampler)
    test_dataset = fake_mnist(1001, 1)
    if args.exact:
        test_dataset = Subset(test_dataset, range(args.rank, len(test_dataset), dist.get_world_size()))
        test_sampler = None
    else:
        test_sampler = torch.utils.data.distributed.DistributedSampler(test_dataset)
    test_loader = torch.utils.data.DataLoader(dataset=test_dataset, batch_size=args.batch_size, shuffle=False,
                                              num_workers=0, pin_memory=False, sampler=test_sampler)
    start = datetime.now()
    total_step = len(train_loader)
    for epoch in range(args.epochs):
        train_loader.sampler.set_epoch(epoch)
        model.train()
        for i, (images, labels) in enumerate(train_loader):
            outputs = model(images)
            loss = criterion(outputs, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if (i + 1) % 100 == 0 and args.rank == 0:
                print('Epoch [{}/{}], Step [{}/{}], Loss: {:.4f}'.format(epoch + 1, args.epochs, i + 1, total_step,
                                                                         loss.item()))
        evaluate(model, gpu, test_loader, args.rank)
    if args.rank == 0:
        print("Training complete in: " + str(datetime.now() - start))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('-g', '--gpuid', default=0, type=int, help="which gpu to use")
    parser.add_argument('-e', '--epochs', default=1, type=int, metavar='N', help='number of total epochs to run')
    parser.add_argument('-b', '--batch_size', default=4, type=int, metavar='N', help='number of batchsize')
    parser.add_argument("--local_rank", "--local-rank", type=int, default=0, help='rank of current process')
    parser.add_argument("--exact", action="store_true", help="the test set split without padding, a Subset per rank")
    args = parser.parse_args()
    train(args.local_rank, args)


if __name__ == '__main__':
    main()
